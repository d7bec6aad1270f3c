"""Triton kernels of the int4 key sketch (``attention.reference.SKETCH_LEVELS``): written beside the K/V as keys
are stored, and read by a query-aware draft that scores every cached key of a request for one query.

Scoring reads 36 bytes a key and KV head (32 of codes, a 4-byte scale) where the keys themselves take 128 at
head_dim 64: a draft that chooses its positions from its own query reads this, not K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.reference import SKETCH_LEVELS

BLOCK_S = 64  # sketched keys a program scores
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
    scale = tl.maximum(largest, 1.1754943508222875e-38) / LEVELS
    low = tl.minimum(tl.maximum(_round_half_even(even / scale), -LEVELS), LEVELS).to(tl.int32) + 8
    high = tl.minimum(tl.maximum(_round_half_even(odd / scale), -LEVELS), LEVELS).to(tl.int32) + 8
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
def _sketch_logits_kernel(
    Q, Codes, Scales, Slots, Out, stride_qn, stride_qh, stride_qg, stride_cs, stride_ch, stride_ss, stride_sh,
    stride_pn, stride_ph, stride_on, stride_oh, stride_og, num_kv_heads, group, length,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (request, KV head) and ``BLOCK_S`` of its slots: the group's queries against the sketched keys there,
    even and odd channels as two dots (a key's codes are unpacked, never dequantised), times each key's scale."""
    request = tl.program_id(0) // num_kv_heads
    head = tl.program_id(0) % num_kv_heads
    entries = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    entry_valid = entries < length
    heads = tl.arange(0, BLOCK_G)
    head_valid = heads < group
    pairs = tl.arange(0, BLOCK_HALF)
    pair_valid = pairs < HALF
    q = Q + request * stride_qn + head * stride_qh + heads[:, None] * stride_qg + 2 * pairs[None, :]
    q_mask = head_valid[:, None] & pair_valid[None, :]
    q_even = tl.load(q, mask=q_mask, other=0.0).to(tl.float32)
    q_odd = tl.load(q + 1, mask=q_mask, other=0.0).to(tl.float32)
    slots = tl.load(Slots + request * stride_pn + head * stride_ph + entries, mask=entry_valid, other=0).to(tl.int64)
    packed = tl.load(
        Codes + slots[:, None] * stride_cs + head * stride_ch + pairs[None, :],
        mask=entry_valid[:, None] & pair_valid[None, :],
        other=8 | (8 << 4),  # codes of zero
    ).to(tl.int32)
    low = ((packed & 15) - 8).to(tl.float32)
    high = ((packed >> 4) - 8).to(tl.float32)
    dots = tl.dot(q_even, tl.trans(low), input_precision=DOT_PRECISION)
    dots += tl.dot(q_odd, tl.trans(high), input_precision=DOT_PRECISION)
    scale = tl.load(Scales + slots * stride_ss + head * stride_sh, mask=entry_valid, other=0.0)
    out = Out + request * stride_on + head * stride_oh + heads[:, None] * stride_og + entries[None, :]
    tl.store(out, dots * scale[None, :], mask=head_valid[:, None] & entry_valid[None, :])


def sketch_logits(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """See :func:`attention.reference.sketch_logits`. Codes are exact in any float type, so the dots round only the
    queries: fp32 queries keep fp32 products (``ieee``), others take tf32."""
    query, slots = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, slots))
    num, num_kv_heads, group, _ = query.shape
    length, half = slots.shape[-1], codes.shape[2]
    out = torch.empty(num, num_kv_heads, group, length, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    _sketch_logits_kernel[(num * num_kv_heads, triton.cdiv(length, BLOCK_S))](
        query, codes, scales, slots, out, query.stride(0), query.stride(1), query.stride(2), codes.stride(0),
        codes.stride(1), scales.stride(0), scales.stride(1), slots.stride(0), slots.stride(1), out.stride(0),
        out.stride(1), out.stride(2), num_kv_heads, group, length, HALF=half,
        BLOCK_HALF=max(MIN_DOT, triton.next_power_of_2(half)), BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_S=BLOCK_S, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
