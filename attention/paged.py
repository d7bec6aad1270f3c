"""Triton paged attention over slot lists: one launch for a packed batch of decode, draft, verify and prefill
requests, with split-KV (flash-decoding) and the verify scores PillarAttn learns from.

Same layout and semantics as :mod:`attention.reference` (the specification these kernels are tested
against). Work is split as (request, tile of query rows, KV head, KV split): the rows of a tile are the
query tokens of one request times the query heads of one GQA group, so every K/V row a program gathers
serves the whole group. A batch may carry two slot-list sets: requests ``b < num_first`` read the first
(for example sparse per-KV-head draft lists), the others the second (shared full-attention lists), which
is how draft and verify requests share a launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.reference import FirstLists

LOG2E = 1.4426950408889634
BLOCK_N = 64  # list entries per block of the verify-score pass
MIN_SPLIT_ENTRIES = 256  # a KV split never holds fewer list entries than this
MAX_SPLITS = 64
TARGET_PROGRAMS = 528  # ~4 waves of an H200's 132 SMs: lists are cut into chunks of about equal work


@triton.jit
def _attend_tile(
    Q,
    K,
    V,
    Out,
    Lse,
    idx_ptr,
    q_start,
    q_len,
    kv_len,
    tile,
    kv_head,
    split,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    scale_log2,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of one tile of (query token, group head) rows over split ``split`` of ``num_splits`` of
    the visible list entries; writes the normalised partial output and its LSE (natural log)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_valid = token < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        Q + (q_start + token)[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(K.dtype.element_ty)

    # Query token i sees list entries j <= last_visible(i) (and > last_visible(i) - window).
    last_visible = kv_len - q_len + token
    first_token = tile * BLOCK_M // GROUP
    last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    hi = kv_len - q_len + last_token + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, kv_len - q_len + first_token - window + 1)
    split_size = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    split_lo = lo + split * split_size
    split_hi = tl.minimum(hi, split_lo + split_size)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(split_lo, split_hi, BLOCK_N):
        entries = start + tl.arange(0, BLOCK_N)
        slots = tl.load(idx_ptr + entries, mask=entries < split_hi, other=-1)
        present = slots >= 0
        k = tl.load(
            K + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=present[:, None] & dim_valid[None, :],
            other=0.0,
        )
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        visible = present[None, :] & (entries[None, :] <= last_visible[:, None])
        if HAS_WINDOW:
            visible = visible & (entries[None, :] > last_visible[:, None] - window)
        logits = tl.where(visible, logits * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=present[:, None] & dim_valid[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tok = q_start + token
    tl.store(
        Out + tok[:, None] * stride_ot + q_head[:, None] * stride_oh + split * stride_os + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )
    tl.store(Lse + tok * stride_lt + q_head * stride_lh + split * stride_ls, lse, mask=row_valid)


@triton.jit
def _attention_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_seqlens_q,
    indptr_first,
    indices_first,
    indptr_second,
    indices_second,
    num_first,
    stride_idx_first,
    stride_idx_second,
    splits_first,
    splits_second,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    scale_log2,
    window,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M_FIRST: tl.constexpr,
    BLOCK_M_SECOND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (request, row tile, KV head, split slot). Each list set has its own row tile (e.g. 16 rows for
    one-token drafts, 32 for a 9-token verify) and split count, so short sparse lists and long full lists
    in one launch each get work of a similar size; split slots beyond a request's own count write empty
    partials (LSE -inf) that the merge ignores."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    head_split = tl.program_id(2)
    kv_head = head_split // num_splits
    split = head_split % num_splits
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    if b < num_first:
        if tile * BLOCK_M_FIRST < q_len * GROUP:
            kv_start = tl.load(indptr_first + b)
            kv_len = tl.load(indptr_first + b + 1) - kv_start
            _attend_tile(
                Q, K, V, Out, Lse, indices_first + kv_head * stride_idx_first + kv_start, q_start, q_len, kv_len,
                tile, kv_head, split, splits_first, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs,
                stride_vh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls, scale_log2, window,
                GROUP, HEAD_DIM, BLOCK_D, BLOCK_M_FIRST, BLOCK_N, HAS_WINDOW, DOT_PRECISION,
            )  # fmt: skip
    else:
        if tile * BLOCK_M_SECOND < q_len * GROUP:
            kv_start = tl.load(indptr_second + b - num_first)
            kv_len = tl.load(indptr_second + b - num_first + 1) - kv_start
            _attend_tile(
                Q, K, V, Out, Lse, indices_second + kv_head * stride_idx_second + kv_start, q_start, q_len, kv_len,
                tile, kv_head, split, splits_second, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs,
                stride_vh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls, scale_log2, window,
                GROUP, HEAD_DIM, BLOCK_D, BLOCK_M_SECOND, BLOCK_N, HAS_WINDOW, DOT_PRECISION,
            )  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    PartOut,
    PartLse,
    Out,
    Lse,
    num_heads,
    num_splits,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (token, head): combine the splits' normalised outputs by their LSE weights."""
    token = tl.program_id(0) // num_heads
    head = tl.program_id(0) % num_heads
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < num_splits
    lse = tl.load(PartLse + token * stride_lt + head * stride_lh + splits, mask=split_valid, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top_safe)
    total = tl.sum(weight, axis=0)
    dims = tl.arange(0, BLOCK_D)
    part = tl.load(
        PartOut + token * stride_pt + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
        mask=split_valid[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + token * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty), mask=dims < HEAD_DIM)
    tl.store(
        Lse + token * num_heads + head,
        tl.where(total > 0, top_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf")),
    )


@triton.jit
def _mass_kernel(
    Q,
    K,
    Lse,
    Mass,
    cu_seqlens_q,
    kv_indptr,
    kv_indices,
    num_scored,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_lt,
    stride_lh,
    stride_mh,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (request, KV head, block of list entries): exact probabilities ``exp(q.k * scale - lse)`` of the
    request's last ``num_scored`` queries, summed over them and the group's heads, divided by their count."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)
    count = tl.load(num_scored + b)
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    if count == 0 or block * BLOCK_N >= kv_len:
        return
    q_end = tl.load(cu_seqlens_q + b + 1)
    q_len = q_end - tl.load(cu_seqlens_q + b)
    count = tl.minimum(count, q_len)

    rows = tl.arange(0, BLOCK_M)
    token = rows // GROUP  # 0 .. count - 1 among the scored queries
    q_head = kv_head * GROUP + rows % GROUP
    row_valid = token < count
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    tok = q_end - count + token
    q = tl.load(
        Q + tok[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(K.dtype.element_ty)
    lse = tl.load(Lse + tok * stride_lt + q_head * stride_lh, mask=row_valid, other=float("inf"))
    entries = block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_list = entries < kv_len
    slots = tl.load(kv_indices + kv_start + entries, mask=in_list, other=0)
    k = tl.load(
        K + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
        mask=in_list[:, None] & dim_valid[None, :],
        other=0.0,
    )
    logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    last_visible = kv_len - count + token
    visible = row_valid[:, None] & in_list[None, :] & (entries[None, :] <= last_visible[:, None])
    probs = tl.where(visible, tl.exp2(logits * scale_log2 - lse[:, None] * 1.4426950408889634), 0.0)
    mass = tl.sum(probs, axis=0) / (count * GROUP)
    tl.store(Mass + kv_head * stride_mh + kv_start + entries, mass, mask=in_list)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply exactly (IEEE), not in TF32, so fp32 runs match the reference token for token."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _block_m(rows: int) -> int:
    """Row tile: all of a small request's (token, head) rows in one tile, at most 64."""
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def _split_counts(num_kv_heads: int, groups: list[tuple[int, int, int]]) -> list[int]:
    """Flash-decoding split count per list set (``(requests, row tiles, longest list)`` each): lists are cut
    into chunks of about equal work, ~``TARGET_PROGRAMS`` of them, so a few long verify lists among many short
    draft lists do not leave a tail of long-running programs (and a small batch still fills the GPU)."""
    work = sum(requests * tiles * length for requests, tiles, length in groups) * num_kv_heads
    chunk = max(MIN_SPLIT_ENTRIES, math.ceil(work / TARGET_PROGRAMS))
    return [max(1, min(MAX_SPLITS, math.ceil(length / chunk))) for _, _, length in groups]


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # list entries per inner iteration
    num_warps: int
    num_stages: int


#: Forces one launch configuration (the kernel benchmark's ``--sweep``); None = ``_launch_config``'s choice.
LAUNCH_OVERRIDE: LaunchConfig | None = None


def _launch_config(head_dim: int, block_m: int) -> LaunchConfig:
    """Tile and pipeline shape, from a sweep on the H200 (BLOCK_N 64/128 x 4/8 warps x 2/3 stages, bf16,
    8K context; docs/performance.md): head_dim 64 one-row-tile decodes and drafts read 128 entries per
    iteration (decode 81% of peak vs 61-67% with 64 at batch 128); multi-token tiles (verify) keep 64 with
    3 stages; head_dim 128 decodes use 8 warps and 3 stages (74% vs 63%), verifies 4 warps (8 halve them)."""
    if LAUNCH_OVERRIDE is not None:
        return LAUNCH_OVERRIDE
    single_token_tile = block_m <= 16
    if head_dim <= 64:
        return LaunchConfig(128, 4, 2) if single_token_tile else LaunchConfig(64, 4, 3)
    return LaunchConfig(64, 8, 3) if single_token_tile else LaunchConfig(64, 4, 2)


def _as_rows(indices: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A list set and its per-KV-head stride (0 for one list shared by all heads)."""
    return indices, (indices.stride(0) if indices.dim() == 2 else 0)


def _max_len(cu: torch.Tensor) -> int:
    """Longest range of an indptr/cu_seqlens tensor (a device sync: hints avoid it)."""
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    first_lists: FirstLists | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`attention.reference.paged_attention` (same arguments and results).

    ``max_q_len``/``max_kv_len`` bound the query and list lengths of the requests that read
    ``kv_indptr``/``kv_indices`` (read from the tensors when omitted, at the cost of a device sync);
    ``first_lists`` gives the first requests their own lists (one launch for drafts and verifies);
    ``num_splits`` forces the KV split count (tests).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    num_requests = cu_seqlens_q.shape[0] - 1
    first = first_lists if first_lists is not None else FirstLists(0, kv_indptr, kv_indices, 0, 0)
    out = torch.empty_like(query)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=query.device)
    if num_tokens == 0 or num_requests == 0:
        return out, lse
    num_first, num_second = first.num_requests, num_requests - first.num_requests
    first_q = first.max_q_len if first.max_q_len is not None else _max_len(cu_seqlens_q[: num_first + 1])
    first_kv = first.max_kv_len if first.max_kv_len is not None else _max_len(first.kv_indptr)
    second_q = max_q_len if max_q_len is not None else _max_len(cu_seqlens_q[num_first:])
    second_kv = max_kv_len if max_kv_len is not None else _max_len(kv_indptr)
    block_m = [_block_m(first_q * group), _block_m(second_q * group)]
    tiles = [triton.cdiv(first_q * group, block_m[0]), triton.cdiv(second_q * group, block_m[1])]
    if num_splits is None:
        splits = _split_counts(num_kv_heads, [(num_first, tiles[0], first_kv), (num_second, tiles[1], second_kv)])
    else:
        splits = [num_splits, num_splits]
    max_splits = max(splits)
    launch = _launch_config(head_dim, max(block_m[i] for i in range(2) if tiles[i]))
    if max_splits == 1:
        part_out, part_lse = out[:, :, None], lse[:, :, None]
    else:
        part_out = torch.empty(num_tokens, num_heads, max_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, max_splits, dtype=torch.float32, device=query.device)
    first_indices, stride_first = _as_rows(first.kv_indices)
    second_indices, stride_second = _as_rows(kv_indices)
    _attention_kernel[(num_requests, max(tiles), num_kv_heads * max_splits)](
        query,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        cu_seqlens_q,
        first.kv_indptr,
        first_indices,
        kv_indptr,
        second_indices,
        num_first,
        stride_first,
        stride_second,
        splits[0],
        splits[1],
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        scale * LOG2E,
        sliding_window or 0,
        max_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M_FIRST=block_m[0],
        BLOCK_M_SECOND=block_m[1],
        BLOCK_N=launch.block_n,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if max_splits > 1:
        _merge_splits_kernel[(num_tokens * num_heads,)](
            part_out,
            part_lse,
            out,
            lse,
            num_heads,
            max_splits,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            BLOCK_S=max(2, triton.next_power_of_2(max_splits)),
        )
    return out, lse


def attention_mass(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    num_scored_queries: torch.Tensor,
    *,
    max_scored: int | None = None,
    max_kv_len: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`attention.reference.attention_mass` (same arguments and result): a second
    pass over the K rows of scored requests only, re-materialising probabilities from the returned LSE."""
    num_kv_heads = k_cache.shape[1]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    mass = torch.zeros(num_kv_heads, kv_indices.shape[-1], dtype=torch.float32, device=query.device)
    num_requests = cu_seqlens_q.shape[0] - 1
    if num_requests == 0 or kv_indices.shape[-1] == 0:
        return mass
    if max_scored is None:
        max_scored = int(num_scored_queries.max())
    if max_kv_len is None:
        max_kv_len = int((kv_indptr[1:] - kv_indptr[:-1]).max())
    if max_scored == 0:
        return mass
    _mass_kernel[(num_requests, num_kv_heads, triton.cdiv(max_kv_len, BLOCK_N))](
        query,
        k_cache,
        lse,
        mass,
        cu_seqlens_q,
        kv_indptr,
        kv_indices,
        num_scored_queries,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        lse.stride(0),
        lse.stride(1),
        mass.stride(0),
        scale * LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=max(16, triton.next_power_of_2(max_scored * group)),
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=_dot_precision(query.dtype),
    )
    return mass
