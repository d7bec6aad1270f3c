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

import functools
import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention import reference
from attention.reference import FirstLists

LOG2E = reference.LOG2E
MASS_MAX_LOG2: tl.constexpr = tl.constexpr(reference.MASS_MAX_LOG2)
MIN_SPLIT_ENTRIES = 256  # a KV split never holds fewer list entries than this
MAX_SPLITS = 64
MERGE_TILE = 8192  # partial outputs one merge program combines (heads x splits x head_dim): a few per thread
# A program's fixed cost in blocks of list entries (pipeline fill, its partial output and the merge's read of
# it): what one more split costs against shorter chunks. Fitted on the H200: over the (point, case) pairs timed
# under several split counts (benchmarks/results/kernels_h200_splits.jsonl), the simulated launch time (``_makespan``)
# at 2 blocks orders 361 of the 377 pairs that differ by 4% or more as measured (3 or 4 blocks do as well).
SPLIT_OVERHEAD_BLOCKS = 2
# Programs a launch keeps resident where no GPU says (the CPU interpreter): four on each of an H200's 132 SMs.
NOMINAL_RESIDENT_PROGRAMS = 528
#: Resident programs per (device, dtypes, compile-time configuration) of the attention kernel, read once from its
#: compiled form (``_resident_programs``).
_RESIDENT: dict[tuple, int] = {}


@triton.jit
def _load_rows(base, slots, stride_slot, offset, dims, rows_valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    """Gather one K or V row per slot; masks only what can be out of range (missing slots, padded dims)."""
    ptrs = base + slots[:, None] * stride_slot + offset + dims[None, :]
    if MASKED:
        return tl.load(ptrs, mask=rows_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _entry_logits(q, K, slot, kv_head, stride_ks, stride_kh, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each row's logit for the K row at ``slot`` (unscaled)."""
    k = tl.load(K + slot * stride_ks + kv_head * stride_kh + dims, mask=dims < HEAD_DIM, other=0.0)
    return tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1)


@triton.jit
def _attend_block(
    q,
    m_i,
    l_i,
    acc,
    start,
    end,
    idx_ptr,
    K,
    V,
    kv_head,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    last_visible,
    window,
    scale_log2,
    mass_base,
    mass_ptr,
    mass_end,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCORED: tl.constexpr,
):
    """One block of ``BLOCK_N`` list entries folded into the online softmax (running max in log2 units of the
    scaled logits). ``MASKED=False`` is for blocks that are whole, visible to every row and free of padding:
    no masks, and a running max that cannot be -inf after the block. ``SCORED``: also writes each entry's verify
    mass (see ``reference.paged_attention``) to ``mass_ptr`` for entries below ``mass_end``, relative to each row's
    ``mass_base`` (its sink logit in log2 units; +inf for rows not scored)."""
    entries = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    slots = tl.load(idx_ptr + entries, mask=entries < end, other=-1) if MASKED else tl.load(idx_ptr + entries)
    present = slots >= 0
    k = _load_rows(K, slots, stride_ks, kv_head * stride_kh, dims, present, HEAD_DIM, BLOCK_D, MASKED)
    logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        visible = present[None, :] & (entries[None, :] <= last_visible[:, None])
        if HAS_WINDOW:
            visible = visible & (entries[None, :] > last_visible[:, None] - window)
        logits = tl.where(visible, logits, float("-inf"))
    if SCORED:
        weights = tl.exp2(tl.minimum(logits * scale_log2 - mass_base[:, None], MASS_MAX_LOG2))
        tl.store(mass_ptr + entries, tl.sum(weights, axis=0).to(mass_ptr.dtype.element_ty),
                 mask=entries < mass_end)  # fmt: skip
    m_new = tl.maximum(m_i, tl.max(logits, axis=1) * scale_log2)
    m_ref = m_new
    if MASKED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: p = alpha = 0
    p = tl.exp2(logits * scale_log2 - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    v = _load_rows(V, slots, stride_vs, kv_head * stride_vh, dims, present, HEAD_DIM, BLOCK_D, MASKED)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _attend_work(
    work,
    first_request,
    Q,
    K,
    V,
    Out,
    Lse,
    cu_seqlens_q,
    indptr,
    ends,
    indices,
    stride_idx,
    num_kv_heads,
    num_tiles,
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
    Mass,
    num_scored,
    stride_mh,
    stride_mb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PADDED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCORED: tl.constexpr,
):
    """Work item ``work`` of one list set, numbered with the KV head fastest (a slot's heads are adjacent in the
    pool), then the split, the row tile and the request: the online softmax of one tile of (query token, group
    head) rows over split ``split`` of ``num_splits`` of the visible list entries; writes the normalised
    partial output and its LSE (natural log). A request's tiles end at its last row (the first one may start
    before its first); a tile past its request's rows reads and writes nothing. The request's list is
    ``indices[indptr[request]:ends[request]]`` (``ends``: ``indptr + 1``, or a draft round's shorter prefixes).
    ``PADDED``: the set's lists are per KV head and may hold -1 padding anywhere, so every block is masked;
    shared lists hold only real slots (the reference's contract), so their whole visible blocks are not.
    ``SCORED``: the request's last ``num_scored`` query tokens (all in its last tile) also write the verify mass of
    the split's entries to the request's row of ``Mass``."""
    kv_head = work % num_kv_heads
    rest = work // num_kv_heads
    split = rest % num_splits
    rest = rest // num_splits
    tile = rest % num_tiles
    request = rest // num_tiles
    q_start = tl.load(cu_seqlens_q + first_request + request)
    q_len = tl.load(cu_seqlens_q + first_request + request + 1) - q_start
    kv_start = tl.load(indptr + request)
    kv_len = tl.load(ends + request) - kv_start
    idx_ptr = indices + kv_head * stride_idx + kv_start
    request_tiles = tl.cdiv(q_len * GROUP, BLOCK_M)
    rows = q_len * GROUP - (request_tiles - tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = (rows >= 0) & (rows < q_len * GROUP)
    rows = tl.maximum(rows, 0)  # rows before the request's first repeat it, unwritten
    token = rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        Q + (q_start + token)[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(K.dtype.element_ty)

    # Query token i sees list entries j <= last_visible(i) (and > last_visible(i) - window).
    last_visible = kv_len - q_len + token
    first_token = tl.min(token, axis=0)
    last_token = tl.max(token, axis=0)
    hi = kv_len - q_len + last_token + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, kv_len - q_len + first_token - window + 1)
    hi = tl.where(tile < request_tiles, hi, lo)  # a tile with no query row of the request reads nothing
    split_size = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    split_lo = lo + split * split_size
    split_hi = tl.minimum(hi, split_lo + split_size)

    # Blocks every row of the tile sees whole (no causal edge, window or padding inside) skip the masking.
    full_hi = split_lo
    if not PADDED and not HAS_WINDOW:
        open_end = tl.minimum(split_hi, kv_len - q_len + first_token + 1)
        full_hi = split_lo + tl.maximum(0, open_end - split_lo) // BLOCK_N * BLOCK_N
    mass_base = tl.zeros([BLOCK_M], tl.float32)
    mass_ptr = Mass
    mass_end = 0
    if SCORED:
        count = tl.minimum(tl.load(num_scored + request), q_len)
        scored = row_valid & (token >= q_len - count)
        # Relative to the larger of each row's logits for the list's first entry (the sink) and its last (the
        # newest token): a base no pass has to finish first, and near the row's largest logit in sink and in
        # local heads alike (weights past 2 ** MASS_MAX_LOG2 would tie).
        first = _entry_logits(q, K, tl.load(idx_ptr, mask=kv_len > 0, other=0), kv_head, stride_ks, stride_kh, dims,
                              HEAD_DIM, BLOCK_D)  # fmt: skip
        last = _entry_logits(q, K, tl.load(idx_ptr + tl.maximum(kv_len - 1, 0), mask=kv_len > 0, other=0), kv_head,
                             stride_ks, stride_kh, dims, HEAD_DIM, BLOCK_D)  # fmt: skip
        mass_base = tl.where(scored, tl.maximum(first, last) * scale_log2, float("inf"))
        mass_ptr = Mass + kv_head * stride_mh + request * stride_mb
        mass_end = tl.where((count > 0) & (tile == request_tiles - 1), split_hi, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(split_lo, full_hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, start, split_hi, idx_ptr, K, V, kv_head, stride_ks, stride_kh, stride_vs, stride_vh,
            last_visible, window, scale_log2, mass_base, mass_ptr, mass_end, HEAD_DIM, BLOCK_D, BLOCK_N,
            False, HAS_WINDOW, DOT_PRECISION, SCORED,
        )  # fmt: skip
    # The masked blocks are the whole range of padded lists and windows (pipelined like the main loop), else at
    # most two blocks at the causal edge, where a pipeline's prologue would cost more than it hides.
    for start in tl.range(full_hi, split_hi, BLOCK_N, num_stages=None if PADDED or HAS_WINDOW else 1):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, start, split_hi, idx_ptr, K, V, kv_head, stride_ks, stride_kh, stride_vs, stride_vh,
            last_visible, window, scale_log2, mass_base, mass_ptr, mass_end, HEAD_DIM, BLOCK_D, BLOCK_N,
            True, HAS_WINDOW, DOT_PRECISION, SCORED,
        )  # fmt: skip

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
def _replay_plan(live_requests, tiles_first, splits_first, tiles_second, splits_second, num_kv_heads, resident,
                 max_splits):  # fmt: skip
    """Requests and split counts of a launch replayed from a CUDA graph, whose grid and split counts were fixed at
    capture for a bucket of requests: ``live_requests`` holds how many of each list set's requests are real (a
    prefix; the rest are padding with empty lists). When the real requests' programs at the capture's split counts
    leave most of a wave of ``resident`` programs idle (two requests replaying a bucket of 32), both counts grow by
    the whole number of times those programs fit the wave (at most ``max_splits``), so a few long lists are read by
    many programs at once rather than block after block by a few. Returns (first set's requests, its splits,
    second set's requests, its splits)."""
    live_first = tl.load(live_requests).to(tl.int32)
    live_second = tl.load(live_requests + 1).to(tl.int32)
    programs = (live_first * tiles_first * splits_first + live_second * tiles_second * splits_second) * num_kv_heads
    scale = tl.maximum(resident // tl.maximum(programs, 1), 1)
    return (live_first, tl.minimum(splits_first * scale, max_splits), live_second,
            tl.minimum(splits_second * scale, max_splits))  # fmt: skip


# Per-step counts, list lengths and output strides (their values change with every batch): left unspecialised, so a
# new batch composition never compiles a new variant (Triton otherwise specialises an int on being 1 or a
# multiple of 16; on W1 such variants cost seconds of compilation in the first steps).
_PER_STEP = [
    f"{name}_{group}"
    for group in ("first", "second")
    for name in (
        "stride_idx",
        "stride_ot",
        "stride_oh",
        "stride_os",
        "stride_lt",
        "stride_lh",
        "stride_ls",
        "tiles",
        "splits",
    )
]


# Arrays a program reads a few scalars of: aligned loads buy nothing, and as rows of a graph's per-forward buffers
# (a chain graph's list ends, [forwards, D']) or views one past an indptr's start (its ends) their addresses vary
# in alignment, so Triton would compile each kernel twice (1-4 s apiece on an H200, mid-run).
_SCALAR_ARRAYS = ["cu_seqlens_q", "indptr_first", "ends_first", "indptr_second", "ends_second", "num_scored",
                  "live_requests"]  # fmt: skip


# ``resident`` (the wave a launch is planned for) is read from the binary of a first compile planned for the nominal
# wave: specialised, the real launch compiled a second variant whenever the two differ in being a multiple of 16.
@triton.jit(
    do_not_specialize=["num_first", "programs_second", "window", "stride_mh", "stride_mb", "resident", *_PER_STEP],
    do_not_specialize_on_alignment=_SCALAR_ARRAYS,
)
def _attention_kernel(
    Q,
    K,
    V,
    cu_seqlens_q,
    num_first,
    programs_second,
    num_kv_heads,
    indptr_second,
    ends_second,
    indices_second,
    stride_idx_second,
    Out_second,
    Lse_second,
    stride_ot_second,
    stride_oh_second,
    stride_os_second,
    stride_lt_second,
    stride_lh_second,
    stride_ls_second,
    tiles_second,
    splits_second,
    indptr_first,
    ends_first,
    indices_first,
    stride_idx_first,
    Out_first,
    Lse_first,
    stride_ot_first,
    stride_oh_first,
    stride_os_first,
    stride_lt_first,
    stride_lh_first,
    stride_ls_first,
    tiles_first,
    splits_first,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    scale_log2,
    window,
    Mass,
    num_scored,
    stride_mh,
    stride_mb,
    live_requests,
    resident,
    max_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M_FIRST: tl.constexpr,
    BLOCK_M_SECOND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    PADDED_FIRST: tl.constexpr,
    PADDED_SECOND: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCORED: tl.constexpr,
    LIVE: tl.constexpr,
):
    """A flat grid of work items: the second list set's first (shared full lists: the long verify, decode
    and prefill work), then the first set's (short sparse drafts), so the GPU starts the longest programs
    first and the short ones fill in behind them. Each set has its own row tile and split count, and writes
    where its host side says: straight to the output when it is not split. A set without requests is compiled
    out: its code would otherwise count towards the registers and shared memory of every program.
    ``LIVE``: a graph's replay, whose real requests and split counts are read from the device (``_replay_plan``);
    programs past their work exit, and both sets write split outputs."""
    pid = tl.program_id(0)
    if LIVE:
        live_first, splits_first, live_second, splits_second = _replay_plan(
            live_requests, tiles_first, splits_first, tiles_second, splits_second, num_kv_heads, resident, max_splits
        )
        programs_second = live_second * tiles_second * num_kv_heads * splits_second
        if pid >= programs_second + live_first * tiles_first * num_kv_heads * splits_first:
            return
    if pid < programs_second:
        if HAS_SECOND:
            _attend_work(
                pid, num_first, Q, K, V, Out_second, Lse_second, cu_seqlens_q, indptr_second, ends_second,
                indices_second, stride_idx_second, num_kv_heads, tiles_second, splits_second, stride_qt, stride_qh,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_ot_second, stride_oh_second, stride_os_second,
                stride_lt_second, stride_lh_second, stride_ls_second, scale_log2, window, Mass, num_scored, stride_mh,
                stride_mb, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M_SECOND, BLOCK_N, PADDED_SECOND, HAS_WINDOW, DOT_PRECISION,
                SCORED,
            )  # fmt: skip
    elif HAS_FIRST:
        _attend_work(
            pid - programs_second, 0, Q, K, V, Out_first, Lse_first, cu_seqlens_q, indptr_first, ends_first,
            indices_first, stride_idx_first, num_kv_heads, tiles_first, splits_first, stride_qt, stride_qh, stride_ks,
            stride_kh, stride_vs, stride_vh, stride_ot_first, stride_oh_first, stride_os_first, stride_lt_first,
            stride_lh_first, stride_ls_first, scale_log2, window, Mass, num_scored, stride_mh, stride_mb, GROUP,
            HEAD_DIM, BLOCK_D, BLOCK_M_FIRST, BLOCK_N, PADDED_FIRST, HAS_WINDOW, DOT_PRECISION, False,
        )  # fmt: skip


@triton.jit(
    do_not_specialize=["num_first", "splits_first", "splits_second", "stride_pt", "stride_ph", "stride_ps", "stride_lt",
                       "tiles_first", "tiles_second", "resident"],
    do_not_specialize_on_alignment=["cu_seqlens_q", "live_requests"],
)  # fmt: skip
def _merge_splits_kernel(
    PartOut,
    PartLse,
    Out,
    Lse,
    cu_seqlens_q,
    num_first,
    splits_first,
    splits_second,
    live_requests,
    tiles_first,
    tiles_second,
    num_kv_heads,
    resident,
    max_splits,
    num_heads,
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
    BLOCK_H: tl.constexpr,
    LIVE: tl.constexpr,
):
    """One token, ``BLOCK_H`` of its heads: combine the splits' normalised outputs by their LSE weights. Tokens of
    a list set that was not split were written straight to the output by the attention kernel. (A program per
    (token, head) took 20 us a layer for a verify's 2,304 x 9 rows on an H100.) ``LIVE``: the replay's split
    counts, as the attention kernel read them (every set was split there); tokens of no real request get a zero
    output and a -inf LSE."""
    token = tl.program_id(0)
    in_first = token < tl.load(cu_seqlens_q + num_first)
    num_splits = tl.where(in_first, splits_first, splits_second)
    if LIVE:
        live_first, splits_first, live_second, splits_second = _replay_plan(
            live_requests, tiles_first, splits_first, tiles_second, splits_second, num_kv_heads, resident, max_splits
        )
        live_end = tl.load(cu_seqlens_q + tl.where(in_first, live_first, num_first + live_second))
        num_splits = tl.where(token < live_end, tl.where(in_first, splits_first, splits_second), 0)
    elif num_splits == 1:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    head_valid = heads < num_heads
    split_valid = head_valid[:, None] & (splits < num_splits)[None, :]  # [H, S]
    lse_at = PartLse + token * stride_lt + heads[:, None] * stride_lh + splits[None, :]
    lse = tl.load(lse_at, mask=split_valid, other=float("-inf"))
    top = tl.max(lse, axis=1)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top_safe[:, None])
    total = tl.sum(weight, axis=1)
    part = tl.load(
        PartOut + token * stride_pt + heads[:, None, None] * stride_ph + splits[None, :, None] * stride_ps
        + dims[None, None, :],
        mask=split_valid[:, :, None] & (dims < HEAD_DIM)[None, None, :],
        other=0.0,
    )  # fmt: skip
    out = tl.sum(part * weight[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
    written = head_valid[:, None] & (dims < HEAD_DIM)[None, :]
    out_at = Out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_at, out.to(Out.dtype.element_ty), mask=written)
    merged = tl.where(total > 0, top_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(Lse + token * num_heads + heads, merged, mask=head_valid)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply exactly (IEEE), not in TF32, so fp32 runs match the reference token for token."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _block_m(rows: int) -> int:
    """Row tile: all of a small request's (token, head) rows in one tile, at most 64."""
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def _makespan(sets: tuple[tuple[int, int], ...], splits: tuple[int, ...], resident: int, overhead: int) -> int:
    """Time of a launch in blocks read per program: its programs (each ``ceil(blocks / splits) + overhead``
    long) run ``resident`` at a time, each taking the first free slot in launch order, the second set's
    programs (the long full-attention lists) first. Slots that free at the same time are one heap entry."""
    slots = [(0, resident)]  # (time the slots free up, how many)
    for (programs, blocks), n in reversed(list(zip(sets, splits, strict=True))):
        remaining, length = programs * n, triton.cdiv(blocks, n) + overhead
        while remaining:
            time, free = heapq.heappop(slots)
            while slots and slots[0][0] == time:
                free += heapq.heappop(slots)[1]
            if not slots and remaining >= free:  # every slot free at once: whole waves in one step
                waves, remaining = divmod(remaining, free)
                heapq.heappush(slots, (time + waves * length, free))
                continue
            taken = min(free, remaining)
            if free > taken:
                heapq.heappush(slots, (time, free - taken))
            heapq.heappush(slots, (time + length, taken))
            remaining -= taken
    return max(time for time, _ in slots)


@functools.lru_cache(maxsize=1024)
def _split_counts(sets: tuple[tuple[int, int], ...], resident: int, min_chunk: int, overhead: int) -> tuple[int, ...]:
    """Flash-decoding split count per list set, each given as ``(programs per split, longest list in blocks)``.

    Every program reads a chunk of about the same number of blocks (at least ``min_chunk``), so a few long
    verify lists among many short draft lists leave no tail of long programs; how many chunks is planned on
    the launch's simulated time (``_makespan``): a launch of 1.1 waves costs as much as 2, a one-wave launch
    takes the shortest chunks that still fit, and short draft programs fill the slots the verifies leave.
    Fewer splits win ties. Cached: every layer of a step asks the same question."""
    longest = max((blocks for programs, blocks in sets if programs), default=0)
    chunks = {max(min_chunk, triton.cdiv(longest, n)) for n in range(1, MAX_SPLITS + 1)}
    options = {tuple(max(1, min(MAX_SPLITS, triton.cdiv(blocks, chunk))) for _, blocks in sets) for chunk in chunks}
    return min(options, key=lambda splits: (_makespan(sets, splits, resident, overhead), sum(splits)))


def _planned_splits(
    kernel, device: torch.device, config: tuple, lists: tuple[tuple[int, int], ...], block_n: int,
    args_for: Callable[[tuple[int, ...]], list], constexprs: dict, overhead: int = SPLIT_OVERHEAD_BLOCKS,
) -> tuple[tuple[int, ...], int]:  # fmt: skip
    """Split count per list set (``(programs per split, longest list in entries)`` each) of a launch of
    ``kernel``, planned against the programs its compiled form keeps resident: on a GPU read once per device and
    configuration (``config``: dtypes and compile-time constants) from the binary, compiled from the arguments
    ``args_for`` gives the nominal plan; without a GPU the nominal count. Returns the counts and the resident
    programs they were planned for."""
    sizes = tuple((programs, triton.cdiv(length, block_n)) for programs, length in lists)
    min_chunk = triton.cdiv(MIN_SPLIT_ENTRIES, block_n)
    resident = NOMINAL_RESIDENT_PROGRAMS
    if device.type == "cuda":
        key = (kernel.fn.__name__, device, *config)
        if key not in _RESIDENT:
            nominal = _split_counts(sizes, NOMINAL_RESIDENT_PROGRAMS, min_chunk, overhead)
            compiled = kernel.warmup(*args_for(nominal), grid=(1,), **constexprs)
            _RESIDENT[key] = _resident_programs(compiled, torch.cuda.get_device_properties(device))
        resident = _RESIDENT[key]
    return _split_counts(sizes, resident, min_chunk, overhead), resident


def _resident_programs(compiled, props) -> int:
    """Programs of a compiled kernel the GPU runs at once: on each SM, the fewest that its registers
    (allocated per warp in units of 256), shared memory (1 KB reserved per program), threads or the limit of
    32 programs allow. The split count is planned against this, not a fixed target: a 255-register verify
    program fits 4 per SM where a 152-register decode program fits 6, and a launch of 1.1 waves costs 2."""
    compiled._init_handles()  # loads the binary: the register count is known from then on
    warps = compiled.metadata.num_warps
    regs_per_warp = triton.cdiv(compiled.n_regs * 32, 256) * 256
    per_sm = min(
        props.regs_per_multiprocessor // regs_per_warp // warps,
        props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024),
        props.max_threads_per_multi_processor // (32 * warps),
        32,
    )
    return max(1, per_sm) * props.multi_processor_count


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # list entries per inner iteration
    num_warps: int
    num_stages: int


def _launch_config(head_dim: int, block_m: int, dtype: torch.dtype) -> LaunchConfig:
    """Tile and pipeline shape, from sweeps on the H200 (bf16; benchmarks/results/kernels_h200_sweep2/3.jsonl).
    head_dim 64: one-token tiles (decodes, drafts) read 64 entries per iteration with 2 warps and 3 stages;
    32-row tiles (verifies: 9 queries x 3 heads) 128 entries with 2 warps (437 vs 458 us with 4 warps at
    256 x 8K, sweep 3), larger tiles (prefill) 128 with 4 warps. head_dim 128: 64 entries, 4 warps, 3 stages
    for every tile (Qwen3-8B 32 x 8K verify 291 vs 370 us with 128 entries, whose 214 KB of shared memory
    left one program per SM; decode 247 vs 303 us with 8 warps).
    fp32 (exact dots, tests and parity runs) uses small tiles: its FMA-unrolled dots over bigger tiles spill
    (~30,000 spilled registers at head_dim 128 x 64 rows x 128 entries) and take over a minute to compile."""
    if dtype == torch.float32:
        return LaunchConfig(32, 4, 2)
    if head_dim > 64:
        return LaunchConfig(64, 4, 3)
    if block_m <= 16:
        return LaunchConfig(64, 2, 3)
    return LaunchConfig(128, 2 if block_m <= 32 else 4, 3)


@functools.cache
def _shared_memory_budget(device_index: int) -> float:
    """70% of the GPU's shared memory per block: the rest is left to the Q tile, the softmax state and the
    compiler's own buffers."""
    return 0.7 * torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def _fit_shared_memory(launch: LaunchConfig, row_bytes: int, budget: float | None) -> LaunchConfig:
    """Fewer stages, then fewer entries per iteration, until the K/V pipeline buffers (``num_stages - 1``
    blocks of K and V rows of ``row_bytes``) fit ``budget`` bytes (None: no limit, Triton's CPU interpreter).
    fp32 head_dim 128 at 128 entries x 3 stages needs 288 KB of the H200's 227 KB; bf16 needs half."""
    block_n, stages = launch.block_n, launch.num_stages
    while budget is not None and max(1, stages - 1) * block_n * row_bytes * 2 > budget and (stages > 2 or block_n > 16):
        stages, block_n = (stages - 1, block_n) if stages > 2 else (stages, block_n // 2)
    return LaunchConfig(block_n, launch.num_warps, stages)


def _as_rows(indices: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A list set and its per-KV-head stride (0 for one list shared by all heads)."""
    return indices, (indices.stride(0) if indices.dim() == 2 else 0)


def _max_len(cu: torch.Tensor, ends: torch.Tensor | None = None) -> int:
    """Longest range of an indptr/cu_seqlens tensor, or from its starts to ``ends`` (a device sync: hints avoid
    it)."""
    ends = cu[1:] if ends is None else ends
    return int((ends - cu[: ends.shape[0]]).max()) if ends.numel() else 0


@dataclass(frozen=True)
class _ListSet:
    """One list set of a launch (its requests, lists, row tiles and splits) and where its programs write."""

    num_requests: int
    indptr: torch.Tensor
    ends: torch.Tensor  # [num_requests]: where each request's list ends (``indptr[1:]`` unless given)
    indices: torch.Tensor
    tiles: int
    splits: int
    out: torch.Tensor  # [tokens, heads, splits, head_dim]: the output itself (a view) when not split
    lse: torch.Tensor  # [tokens, heads, splits]

    def args(self) -> list:
        indices, stride = _as_rows(self.indices)
        out, lse = self.out, self.lse
        return [self.indptr, self.ends, indices, stride, out, lse, *out.stride()[:3], *lse.stride(), self.tiles,
                self.splits]  # fmt: skip


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
    mass: torch.Tensor | None = None,
    num_scored_queries: torch.Tensor | None = None,
    max_scored_queries: int | None = None,
    num_splits: int | tuple[int, int] | None = None,
    launch: LaunchConfig | None = None,
    split_overhead: int = SPLIT_OVERHEAD_BLOCKS,
    kv_ends: torch.Tensor | None = None,
    live_requests: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`attention.reference.paged_attention` (same arguments and results).

    ``max_q_len``/``max_kv_len`` bound the query and list lengths of the requests that read
    ``kv_indptr``/``kv_indices`` (read from the tensors when omitted, at the cost of a device sync), as
    ``max_scored_queries`` bounds ``num_scored_queries``;
    ``first_lists`` gives the first requests their own lists (one launch for drafts and verifies);
    ``num_splits`` forces the KV split count, of both list sets or ``(first, second)``; ``launch`` the tile
    and pipeline shape; ``split_overhead`` is the split planner's per-program cost in blocks (tests and the
    kernel benchmark's sweeps; by default the planner and ``_launch_config`` choose).

    ``live_requests`` (``[2]`` on the device) marks a launch a CUDA graph replays for fewer requests than it was
    captured with: how many of the first set's requests and of the others' are real (a prefix of each; the rest
    have empty lists). The split counts planned here for every request then grow on the device to fill a wave
    with the real ones (``_replay_plan``), into partial outputs with room for ``MAX_SPLITS``; the merge always
    runs and gives the padding requests' tokens a zero output.
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
    num_first = first.num_requests
    requests = [num_first, num_requests - num_first]
    q_lens = [
        first.max_q_len if first.max_q_len is not None else _max_len(cu_seqlens_q[: num_first + 1]),
        max_q_len if max_q_len is not None else _max_len(cu_seqlens_q[num_first:]),
    ]
    kv_lens = [
        first.max_kv_len if first.max_kv_len is not None else _max_len(first.kv_indptr, first.kv_ends),
        max_kv_len if max_kv_len is not None else _max_len(kv_indptr, kv_ends),
    ]
    block_m = [_block_m(q_len * group) for q_len in q_lens]
    tiles = [triton.cdiv(q_len * group, m) for q_len, m in zip(q_lens, block_m, strict=True)]
    scored = mass is not None and requests[1] > 0
    if scored:
        if kv_indices.dim() != 1 or sliding_window is not None:
            raise ValueError("the verify mass is scored over full lists only (shared by the KV heads, no window)")
        if max_scored_queries is None:
            max_scored_queries = int(num_scored_queries.max())
        if max_scored_queries * group > min(block_m[1], reference.MAX_SCORED_ROWS):
            raise ValueError(
                f"{max_scored_queries} scored queries x {group} heads exceed a tile of {block_m[1]} rows: score at "
                f"most {block_m[1] // group} queries"
            )
    else:
        mass, num_scored_queries = lse, cu_seqlens_q  # placeholders the kernel never reads
    # One pipeline for both sets: the larger tile's. Chosen by which sets are present, not by their sizes: a
    # choice by the heavier set's work flipped as a draining batch mixed a few verifies with many drafts, and
    # each flip compiled another variant of this kernel mid-run (~1 s each).
    tile = max((m for m, r, t in zip(block_m, requests, tiles, strict=True) if r * t), default=block_m[1])
    device = query.device
    budget = _shared_memory_budget(device.index or 0) if device.type == "cuda" else None
    launch = _fit_shared_memory(
        launch or _launch_config(head_dim, tile, query.dtype), _block_d(head_dim) * k_cache.element_size(), budget
    )
    first_ends = first.kv_indptr[1:] if first.kv_ends is None else first.kv_ends
    ends = kv_indptr[1:] if kv_ends is None else kv_ends
    lists = [(first.kv_indptr, first_ends, first.kv_indices), (kv_indptr, ends, kv_indices)]
    constexprs = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M_FIRST=block_m[0],
        BLOCK_M_SECOND=block_m[1],
        BLOCK_N=launch.block_n,
        HAS_FIRST=requests[0] * tiles[0] > 0,
        HAS_SECOND=requests[1] * tiles[1] > 0,
        PADDED_FIRST=lists[0][2].dim() == 2,
        PADDED_SECOND=lists[1][2].dim() == 2,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(query.dtype),
        SCORED=scored,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )

    live = live_requests is not None

    def bind(
        splits: tuple[int, ...], resident: int = NOMINAL_RESIDENT_PROGRAMS
    ) -> tuple[int, list, tuple[torch.Tensor, torch.Tensor] | None]:
        """The launch's program count, its arguments and the splits' partial outputs (None: nothing split)."""
        part = None
        if live or max(splits) > 1:  # room for a replay's counts, which grow on the device up to MAX_SPLITS
            shape = (num_tokens, num_heads, MAX_SPLITS if live else max(splits))
            part = (torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
                    torch.empty(shape, dtype=torch.float32, device=device))  # fmt: skip
        direct = (out[:, :, None], lse[:, :, None])
        sets = [
            _ListSet(requests[i], *lists[i], tiles[i], splits[i], *(part if live or splits[i] > 1 else direct))
            for i in range(2)
        ]
        programs = [s.num_requests * s.tiles * num_kv_heads * s.splits for s in sets]
        args = [query, k_cache, v_cache, cu_seqlens_q, num_first, programs[1], num_kv_heads, *sets[1].args(),
                *sets[0].args(), query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
                v_cache.stride(0), v_cache.stride(1), scale * LOG2E, sliding_window or 0, mass, num_scored_queries,
                mass.stride(0), mass.stride(1) if mass.dim() > 1 else 0, live_requests if live else cu_seqlens_q,
                resident, MAX_SPLITS]  # fmt: skip
        # A replay's programs fill at most a wave, or the capture's own (``_replay_plan``).
        return max(sum(programs), resident) if live else sum(programs), args, part

    constexprs["LIVE"] = live
    if num_splits is not None:
        splits = num_splits if isinstance(num_splits, tuple) else (num_splits, num_splits)
        resident = NOMINAL_RESIDENT_PROGRAMS
    else:
        sizes = tuple((r * t * num_kv_heads, n) for r, t, n in zip(requests, tiles, kv_lens, strict=True))
        config = (query.dtype, k_cache.dtype, *constexprs.items())
        planned, resident = _planned_splits(
            _attention_kernel,
            device,
            config,
            sizes,
            launch.block_n,
            lambda plan: bind(plan)[1],
            constexprs,
            split_overhead,
        )
        # A set with no programs is not split: its outputs stay the direct ones whatever its list-length hint,
        # so their pointer type (part of a compiled variant's key) follows which sets run, not the hint.
        splits = tuple(n if r * t else 1 for n, r, t in zip(planned, requests, tiles, strict=True))
    programs, args, part = bind(splits, resident)
    _attention_kernel[(programs,)](*args, **constexprs)
    if part is not None:
        part_out, part_lse = part
        block_s, block_d = max(2, triton.next_power_of_2(part_lse.shape[2])), _block_d(head_dim)
        block_h = min(triton.next_power_of_2(num_heads), max(1, MERGE_TILE // (block_s * block_d)))
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            part_out,
            part_lse,
            out,
            lse,
            cu_seqlens_q,
            num_first,
            splits[0],
            splits[1],
            live_requests if live else cu_seqlens_q,
            tiles[0],
            tiles[1],
            num_kv_heads,
            resident,
            MAX_SPLITS,
            num_heads,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=block_s,
            BLOCK_H=block_h,
            LIVE=live,
        )
    return out, lse
