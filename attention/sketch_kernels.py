"""Triton kernels of the int4 key sketch (``attention.reference.SKETCH_LEVELS``): written beside the K/V as keys
are stored, and read by a query-aware draft that scores every cached key of a request for one query (the mass a
GQA group would give each, ``sketch_mass``: logits, softmax and group mean in one kernel, nothing stored between).

Scoring reads 36 bytes a key and KV head (32 of codes, a 4-byte scale) where the keys themselves take 128 at
head_dim 64: a draft that chooses its positions from its own query reads this, not K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.reference import LOG2E, SKETCH_LEVELS

BLOCK_S = 64  # sketched keys a program scores per iteration
MIN_DOT = 16  # the smallest dimension tl.dot takes


@triton.jit
def _round_half_even(x):
    """``torch.round``'s rule: halves go to the even neighbour."""
    rounded = tl.floor(x + 0.5)
    odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) != 0.0
    return tl.where(((rounded - x) == 0.5) & odd, rounded - 1.0, rounded)


@triton.jit
def _store_sketch_kernel(
    KCache, Slots, Codes, Scales, stride_ks, stride_kh, stride_cs, stride_ch, stride_ss, stride_sh,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, LEVELS: tl.constexpr,
):  # fmt: skip
    """One (token, KV head): the key at the token's slot, quantised into its codes and scale."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(Slots + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    valid = pairs < HALF
    row = KCache + slot * stride_ks + head * stride_kh
    even = tl.load(row + 2 * pairs, mask=valid, other=0.0).to(tl.float32)
    odd = tl.load(row + 2 * pairs + 1, mask=valid, other=0.0).to(tl.float32)
    largest = tl.maximum(tl.max(tl.abs(even), axis=0), tl.max(tl.abs(odd), axis=0))
    # Divisions rounded as IEEE (and torch) round them: a GPU's default fp32 division is off by up to 2 ulp.
    scale = tl.math.div_rn(tl.maximum(largest, 1.1754943508222875e-38), tl.full((), LEVELS, tl.float32))
    low = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(even, scale)), -LEVELS), LEVELS).to(tl.int32) + 8
    high = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(odd, scale)), -LEVELS), LEVELS).to(tl.int32) + 8
    tl.store(Codes + slot * stride_cs + head * stride_ch + pairs, (low | (high << 4)).to(tl.uint8), mask=valid)
    tl.store(Scales + slot * stride_ss + head * stride_sh, scale)


def store_key_sketch(k_cache: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """See :func:`attention.reference.store_key_sketch`."""
    tokens, num_kv_heads, half = slots.shape[0], codes.shape[1], codes.shape[2]
    if tokens == 0:
        return
    _store_sketch_kernel[(tokens, num_kv_heads)](
        k_cache, slots, codes, scales, k_cache.stride(0), k_cache.stride(1), codes.stride(0), codes.stride(1),
        scales.stride(0), scales.stride(1), HALF=half, BLOCK_HALF=triton.next_power_of_2(half), LEVELS=SKETCH_LEVELS,
    )  # fmt: skip


@triton.jit
def _block_logits(
    Q, Codes, Scales, Slots, request, head, start, length, scale_log2, stride_qn, stride_qh, stride_qg, stride_cs,
    stride_ch, stride_ss, stride_sh, stride_pn, stride_ph, group,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The group's scaled logits (base 2) against ``BLOCK_S`` sketched keys of a row from ``start`` (-inf at
    padding), even and odd channels as two dots (codes unpacked, never dequantised) times each key's scale; and
    those entries' slots."""
    entries = start + tl.arange(0, BLOCK_S)
    heads = tl.arange(0, BLOCK_G)
    pairs = tl.arange(0, BLOCK_HALF)
    pair_valid = pairs < HALF
    q = Q + request * stride_qn + head * stride_qh + heads[:, None] * stride_qg + 2 * pairs[None, :]
    q_mask = (heads < group)[:, None] & pair_valid[None, :]
    q_even = tl.load(q, mask=q_mask, other=0.0).to(tl.float32)
    q_odd = tl.load(q + 1, mask=q_mask, other=0.0).to(tl.float32)
    slots = tl.load(Slots + request * stride_pn + head * stride_ph + entries, mask=entries < length, other=-1)
    valid = slots >= 0
    at = tl.maximum(slots, 0).to(tl.int64)
    packed = tl.load(
        Codes + at[:, None] * stride_cs + head * stride_ch + pairs[None, :],
        mask=valid[:, None] & pair_valid[None, :],
        other=8 | (8 << 4),  # codes of zero
    ).to(tl.int32)
    dots = tl.dot(q_even, tl.trans(((packed & 15) - 8).to(tl.float32)), input_precision=DOT_PRECISION)
    dots += tl.dot(q_odd, tl.trans(((packed >> 4) - 8).to(tl.float32)), input_precision=DOT_PRECISION)
    key_scale = tl.load(Scales + at * stride_ss + head * stride_sh, mask=valid, other=0.0)
    return tl.where(valid[None, :], dots * (key_scale * scale_log2)[None, :], float("-inf")), slots


@triton.jit
def _sketch_mass_kernel(
    Q, Codes, Scales, Slots, Skip, Out, stride_qn, stride_qh, stride_qg, stride_cs, stride_ch, stride_ss, stride_sh,
    stride_pn, stride_ph, stride_on, stride_oh, num_kv_heads, group, length, scale_log2,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (request, KV head) row: each query head's softmax normaliser over the row (one pass, online), then
    each entry's mass averaged over the group (a second pass over the sketch: it is small, and the logits are
    never stored)."""
    request = tl.program_id(0) // num_kv_heads
    head = tl.program_id(0) % num_kv_heads
    args = (Q, Codes, Scales, Slots, request, head)
    strides = (stride_qn, stride_qh, stride_qg, stride_cs, stride_ch, stride_ss, stride_sh, stride_pn, stride_ph)
    highest = tl.full((BLOCK_G,), -1.0e30, tl.float32)  # finite: a row of padding only stays NaN-free
    total = tl.zeros((BLOCK_G,), tl.float32)
    for start in range(0, length, BLOCK_S):
        logits, _ = _block_logits(
            *args, start, length, scale_log2, *strides, group, HALF, BLOCK_HALF, BLOCK_G, BLOCK_S, DOT_PRECISION
        )
        new_highest = tl.maximum(highest, tl.max(logits, axis=1))
        total = total * tl.exp2(highest - new_highest) + tl.sum(tl.exp2(logits - new_highest[:, None]), axis=1)
        highest = new_highest
    heads_valid = tl.arange(0, BLOCK_G) < group
    weight = tl.where(heads_valid & (total > 0), 1.0 / (tl.maximum(total, 1e-30) * group), 0.0)
    skip = tl.load(Skip + request)
    for start in range(0, length, BLOCK_S):
        logits, slots = _block_logits(
            *args, start, length, scale_log2, *strides, group, HALF, BLOCK_HALF, BLOCK_G, BLOCK_S, DOT_PRECISION
        )
        mass = tl.sum(tl.exp2(logits - highest[:, None]) * weight[:, None], axis=0)
        entries = start + tl.arange(0, BLOCK_S)
        never = (slots < 0) | (entries < skip)
        tl.store(
            Out + request * stride_on + head * stride_oh + entries, tl.where(never, -1.0, mass), mask=entries < length
        )


def sketch_mass(
    query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, scale: float,
    skip: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """See :func:`attention.reference.sketch_mass`. Codes are exact in any float type, so the dots round only the
    queries: fp32 queries keep fp32 products (``ieee``), others take tf32."""
    query, slots = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, slots))
    num, num_kv_heads, group, _ = query.shape
    length, half = slots.shape[-1], codes.shape[2]
    out = torch.empty(num, num_kv_heads, length, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    _sketch_mass_kernel[(num * num_kv_heads,)](
        query, codes, scales, slots, skip, out, query.stride(0), query.stride(1), query.stride(2), codes.stride(0),
        codes.stride(1), scales.stride(0), scales.stride(1), slots.stride(0), slots.stride(1), out.stride(0),
        out.stride(1), num_kv_heads, group, length, scale * LOG2E, HALF=half,
        BLOCK_HALF=max(MIN_DOT, triton.next_power_of_2(half)), BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_S=BLOCK_S, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
