"""Triton kernels for the small ops around attention in a decoder layer: RMSNorm, SiLU x mul, and the rotary
embedding with the K/V store.

At batch 256 a small model's forward is bound by how many kernels it launches, not by its FLOPs: transformers'
RMSNorm is seven kernels, its rotary embedding ten per layer, SiLU x mul two, and the K/V store two more. Each
of these is one kernel here, computing what :mod:`attention.reference` computes (the same fp32 steps, rounded
to the input dtype where transformers rounds), so a fused forward gives the model's own numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_row, stride_head, num_heads, dim, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    valid = offs < dim
    x = tl.load(X + row * stride_row + head * stride_head + offs, mask=valid, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(W + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(Out + (row * num_heads + head) * dim + offs, (weight * normed).to(Out.dtype.element_ty), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See :func:`attention.reference.rms_norm`; ``x`` is ``[N, D]`` or ``[N, H, D]`` with unit stride in ``D``
    (a head slice of a fused QKV output is read in place)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 3 or x.stride(0) == x.shape[1] * x.stride(1) else x
    heads = rows.shape[1] if rows.dim() == 3 else 1
    stride_head = rows.stride(1) if rows.dim() == 3 else 0
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows.shape[0], heads)](
        rows, weight, out, rows.stride(0), stride_head, heads, dim, eps, BLOCK_D=block, num_warps=_warps(block)
    )
    return out


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, stride_row, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < width
    gate = tl.load(GateUp + row * stride_row + offs, mask=valid, other=0.0)
    up = tl.load(GateUp + row * stride_row + width + offs, mask=valid, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(Out + row * width + offs, (activated * up).to(Out.dtype.element_ty), mask=valid)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`attention.reference.silu_and_mul`."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    width = rows.shape[1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
        rows, out, rows.stride(0), width, BLOCK=block, num_warps=_warps(block)
    )
    return out


@triton.jit
def _rotate_rows(src, row_stride, rows, valid_rows, cos, sin, dims, partner, sign, valid_dims):
    """Rows ``src + row * row_stride`` (``rows``: their numbers) rotated by ``cos``/``sin`` (fp32), in
    transformers' rounding: each product rounded to the input dtype, then their sum."""
    mask = valid_rows[:, None] & valid_dims[None, :]
    base = src + rows[:, None] * row_stride
    x = tl.load(base + dims[None, :], mask=mask, other=0.0)
    rotated = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32) * sign[None, :]
    first = (x.to(tl.float32) * cos[None, :]).to(x.dtype).to(tl.float32)
    second = (rotated * sin[None, :]).to(x.dtype).to(tl.float32)
    return (first + second).to(x.dtype), mask


@triton.jit(do_not_specialize_on_alignment=["Slots"])  # read one by one; rows of a chain graph's [forwards, D']
def _rotary_store_kernel(
    Q,
    K,
    V,
    Cos,
    Sin,
    QOut,
    KCache,
    VCache,
    Slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_cache_slot,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    """One token, all its heads: its query heads rotated into ``QOut``, its key heads rotated into the cache at
    the token's slot, its value heads copied there. (A program per (token, head) row launched 15 one-warp
    programs a token: 22 us for a verify's 2,304 tokens on an H100, against a few for the same bytes here.)"""
    token = tl.program_id(0)
    dims = tl.arange(0, BLOCK_D)
    valid_dims = dims < HEAD_DIM
    half = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    sign = tl.where(dims < half, -1.0, 1.0)
    cos = tl.load(Cos + token * stride_ct + dims, mask=valid_dims, other=0.0).to(tl.float32)
    sin = tl.load(Sin + token * stride_st + dims, mask=valid_dims, other=0.0).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)
    query, mask = _rotate_rows(
        Q + token * stride_qt, stride_qh, heads, heads < num_heads, cos, sin, dims, partner, sign, valid_dims
    )
    out = QOut + (token * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :]
    tl.store(out, query.to(QOut.dtype.element_ty), mask=mask)
    kv_heads = tl.arange(0, BLOCK_KV)
    valid_kv = kv_heads < num_kv_heads
    row = tl.load(Slots + token) * stride_cache_slot + kv_heads[:, None] * HEAD_DIM + dims[None, :]
    key, mask = _rotate_rows(
        K + token * stride_kt, stride_kh, kv_heads, valid_kv, cos, sin, dims, partner, sign, valid_dims
    )
    tl.store(KCache + row, key.to(KCache.dtype.element_ty), mask=mask)
    value = tl.load(V + token * stride_vt + kv_heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(VCache + row, value.to(VCache.dtype.element_ty), mask=mask)


def rotary_store_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """See :func:`attention.reference.rotary_store_kv`; ``query``/``key``/``value`` may be strided views (unit
    stride in the head dimension), e.g. slices of a fused QKV output. The caches are ``[slots, Hkv, D]``
    with contiguous rows."""
    tokens, num_heads, dim = query.shape
    num_kv_heads = key.shape[1]
    q_out = torch.empty((tokens, num_heads, dim), dtype=query.dtype, device=query.device)
    if tokens == 0:
        return q_out
    block = triton.next_power_of_2(dim)
    block_heads = triton.next_power_of_2(num_heads)
    _rotary_store_kernel[(tokens,)](
        query,
        key,
        value,
        cos,
        sin,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        num_heads,
        num_kv_heads,
        HEAD_DIM=dim,
        BLOCK_D=block,
        BLOCK_H=block_heads,
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        num_warps=_warps(block_heads * block),
    )
    return q_out
