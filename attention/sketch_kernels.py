"""Triton kernels of the int4 key sketch (``attention.reference.SKETCH_LEVELS``): written beside the K/V as keys
are stored, and read by a query-aware draft that scores every cached key of a request for one query (the mass a
GQA group would give each, ``sketch_mass``: logits, softmax and group mean in one kernel over chunks of a row run
in parallel, launched twice: the first stores the logits and per-chunk maxima and normalisers, the second the mass).

Scoring reads 36 bytes a key and KV head (32 of codes, a 4-byte scale) where the keys themselves take 128 at
head_dim 64: a draft that chooses its positions from its own query reads this, not K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.reference import LOG2E, SKETCH_LEVELS

BLOCK_S = 64  # sketched keys a program scores per iteration
MASS_CHUNK = 4 * BLOCK_S  # candidates of a row one program scores (a row's chunks run in parallel)
MASS_CHUNKS_MERGED = 16  # chunk normalisers a program merges per iteration
LIST_BLOCK = 128  # list entries a program writes per iteration
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
    Q, Codes, Scales, Table, Listed, request, head, table_row, prefix, total, listed_from, start, scale_log2, stride_qn,
    stride_qh,
    stride_qg, stride_cs, stride_ch, stride_ss, stride_sh, stride_tr, stride_lr, stride_lh, group,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The group's scaled logits (base 2) against the sketched keys of ``BLOCK_S`` candidates of a row from
    ``start`` (-inf at padding), even and odd channels as two dots (codes unpacked, never dequantised) times each
    key's scale. Candidates: positions 0 .. ``prefix`` - 1, then the listed positions of its slot-table row from
    ``listed_from`` on, ``total`` in all, at their slots in that row."""
    entries = start + tl.arange(0, BLOCK_S)
    heads = tl.arange(0, BLOCK_G)
    pairs = tl.arange(0, BLOCK_HALF)
    pair_valid = pairs < HALF
    q = Q + request * stride_qn + head * stride_qh + heads[:, None] * stride_qg + 2 * pairs[None, :]
    q_mask = (heads < group)[:, None] & pair_valid[None, :]
    q_even = tl.load(q, mask=q_mask, other=0.0).to(tl.float32)
    q_odd = tl.load(q + 1, mask=q_mask, other=0.0).to(tl.float32)
    in_row = entries < total
    listed = in_row & (entries >= prefix)
    at = listed_from + entries - prefix
    from_list = tl.load(Listed + table_row * stride_lr + head * stride_lh + at, mask=listed, other=-1)
    positions = tl.where(listed, from_list, tl.where(in_row, entries, -1))
    slots = tl.load(Table + table_row * stride_tr + tl.maximum(positions, 0), mask=positions >= 0, other=-1)
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
    return tl.where(valid[None, :], dots * (key_scale * scale_log2)[None, :], float("-inf"))


# Widths that grow over a generation (the slot table's, a shortlist's, a step's candidates): one variant of a kernel.
_MASS_WIDTHS = ["stride_tr", "stride_lr", "stride_lh", "stride_on", "stride_oh", "listed_width", "width", "chunks"]
_LIST_WIDTHS = [
    "stride_pn",
    "stride_ph",
    "stride_tr",
    "stride_lr",
    "stride_lh",
    "stride_oh",
    "most",
    "listed_width",
    "width",
]


# Per-request values, read one by one (rows of one transfer or buffer: any alignment).
_PER_REQUEST = ["Rows", "Prefix", "ListedLengths", "Skip", "Sinks", "RecentStart", "Recent"]


@triton.jit(do_not_specialize=_MASS_WIDTHS, do_not_specialize_on_alignment=_PER_REQUEST[:4])
def _sketch_mass_kernel(
    Q, Codes, Scales, Table, Rows, Prefix, Listed, ListedLengths, Skip, Stats, Logits, Out, stride_qn, stride_qh,
    stride_qg, stride_cs, stride_ch, stride_ss, stride_sh, stride_tr, stride_lr, stride_lh, stride_on, stride_oh,
    num_kv_heads, group, listed_width, width, chunks, scale_log2,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, WRITE_MASS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One chunk of ``CHUNK`` candidates of a (request, KV head) row, in one of two launches. The first
    (``WRITE_MASS`` off) writes the group's logits to ``Logits`` and each query head's running maximum and
    normaliser over the chunk to ``Stats``; the second merges its row's chunks into the row's normalisers and writes
    each candidate's mass averaged over the group from the stored logits (12 bytes a candidate for a group of 3,
    where computing them again read its list entry, slot, codes and scale: 1.36-1.39x faster in
    benchmarks/sketch_choice_micro.py on an H100, session 43). A row's chunks run in parallel, so a long row costs
    what a short one does. Entries past the row's candidates are not written."""
    row = tl.program_id(0)
    request = row // num_kv_heads
    head = row % num_kv_heads
    prefix = tl.load(Prefix + request)
    listed_length = tl.load(ListedLengths + request)
    total = tl.minimum(prefix + listed_length, width)  # never past the row
    first = tl.program_id(1) * CHUNK
    last = tl.minimum(first + CHUNK, total)
    heads = tl.arange(0, BLOCK_G)
    in_group = (heads < group)[:, None]
    stats_row = Stats + row.to(tl.int64) * chunks * 2 * BLOCK_G
    logits_row = Logits + row.to(tl.int64) * group * width + heads[:, None] * width  # [group, width] a row
    if not WRITE_MASS:
        table_row = tl.load(Rows + request).to(tl.int64)
        args = (Q, Codes, Scales, Table, Listed, request, head, table_row, prefix, total, listed_width - listed_length)
        strides = (
            stride_qn, stride_qh, stride_qg, stride_cs, stride_ch, stride_ss, stride_sh, stride_tr, stride_lr, stride_lh
        )  # fmt: skip
        highest = tl.full((BLOCK_G,), -1.0e30, tl.float32)  # finite: a chunk of padding only stays NaN-free
        sums = tl.zeros((BLOCK_G,), tl.float32)
        for start in range(first, last, BLOCK_S):
            logits = _block_logits(
                *args, start, scale_log2, *strides, group, HALF, BLOCK_HALF, BLOCK_G, BLOCK_S, DOT_PRECISION
            )
            entries = start + tl.arange(0, BLOCK_S)
            tl.store(logits_row + entries[None, :], logits, mask=in_group & (entries < last)[None, :])
            new_highest = tl.maximum(highest, tl.max(logits, axis=1))
            sums = sums * tl.exp2(highest - new_highest) + tl.sum(tl.exp2(logits - new_highest[:, None]), axis=1)
            highest = new_highest
        at = stats_row + tl.program_id(1) * 2 * BLOCK_G + heads
        tl.store(at, highest)
        tl.store(at + BLOCK_G, sums)
    elif first < total:
        highest = tl.full((BLOCK_G,), -1.0e30, tl.float32)
        sums = tl.zeros((BLOCK_G,), tl.float32)
        for from_chunk in range(0, chunks, BLOCK_C):
            chunk = from_chunk + tl.arange(0, BLOCK_C)
            at = stats_row + chunk[:, None] * 2 * BLOCK_G + heads[None, :]
            valid = (chunk < chunks)[:, None]
            chunk_highest = tl.load(at, mask=valid, other=-1.0e30)
            chunk_sums = tl.load(at + BLOCK_G, mask=valid, other=0.0)
            new_highest = tl.maximum(highest, tl.max(chunk_highest, axis=0))
            sums = sums * tl.exp2(highest - new_highest) + tl.sum(
                chunk_sums * tl.exp2(chunk_highest - new_highest[None, :]), axis=0
            )
            highest = new_highest
        weight = tl.where((heads < group) & (sums > 0), 1.0 / (tl.maximum(sums, 1e-30) * group), 0.0)
        skip = tl.load(Skip + request)
        for start in range(first, last, BLOCK_S):
            entries = start + tl.arange(0, BLOCK_S)
            inside = (entries < last)[None, :]
            logits = tl.load(logits_row + entries[None, :], mask=in_group & inside, other=float("-inf"))
            mass = tl.sum(tl.exp2(logits - highest[:, None]) * weight[:, None], axis=0)
            never = (tl.max(logits, axis=0) == float("-inf")) | (entries < skip)  # padding: no slot, no logit
            tl.store(
                Out + request * stride_on + head * stride_oh + entries, tl.where(never, -1.0, mass),
                mask=entries < last,
            )  # fmt: skip


def sketch_mass(
    query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
    prefix: torch.Tensor, listed: torch.Tensor, listed_lengths: torch.Tensor, scale: float, skip: torch.Tensor,
    width: int,
) -> torch.Tensor:  # fmt: skip
    """See :func:`attention.reference.sketch_mass`. Codes are exact in any float type, so the dots round only the
    queries: fp32 queries keep fp32 products (``ieee``), others take tf32."""
    query, listed = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, listed))
    num, num_kv_heads, group, _ = query.shape
    half = codes.shape[2]
    out = torch.empty(num, num_kv_heads, width, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    chunks = triton.cdiv(width, MASS_CHUNK)
    block_g = max(MIN_DOT, triton.next_power_of_2(group))
    stats = torch.empty(num * num_kv_heads, chunks, 2, block_g, dtype=torch.float32, device=query.device)
    logits = torch.empty(num * num_kv_heads, group, width, dtype=torch.float32, device=query.device)
    for write_mass in (False, True):
        _sketch_mass_kernel[(num * num_kv_heads, chunks)](
            query, codes, scales, table, rows, prefix, listed, listed_lengths, skip, stats, logits, out,
            query.stride(0), query.stride(1), query.stride(2), codes.stride(0), codes.stride(1), scales.stride(0),
            scales.stride(1), table.stride(0), listed.stride(0), listed.stride(1), out.stride(0), out.stride(1),
            num_kv_heads, group, listed.shape[-1], width, chunks, scale * LOG2E, HALF=half,
            BLOCK_HALF=max(MIN_DOT, triton.next_power_of_2(half)), BLOCK_G=block_g, BLOCK_S=BLOCK_S,
            CHUNK=MASS_CHUNK, BLOCK_C=MASS_CHUNKS_MERGED, WRITE_MASS=write_mass,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        )  # fmt: skip
    return out


@triton.jit
def _pick_positions(
    Picks, Listed, picks_row, listed_row, index_at, valid, prefix, sinks, listed_from
):  # fmt: skip
    """The positions of the picks at ``index_at`` of a row (-1: none, or a sink)."""
    index = tl.load(Picks + picks_row + index_at, mask=valid, other=-1)
    listed = valid & (index >= prefix)
    from_list = tl.load(Listed + listed_row + listed_from + index - prefix, mask=listed, other=-1)
    positions = tl.where(listed, from_list, index)
    return tl.where(valid & (index >= sinks), positions, -1)


@triton.jit(do_not_specialize=_LIST_WIDTHS, do_not_specialize_on_alignment=[*_PER_REQUEST[:3], *_PER_REQUEST[4:]])
def _sketch_lists_kernel(
    Picks, Table, Rows, Prefix, Listed, ListedLengths, Sinks, RecentStart, Recent, Out, Ends, stride_pn, stride_ph,
    stride_tr, stride_lr, stride_lh, stride_oh, num_kv_heads, most, listed_width, width,
    SPAN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One (request, KV head) list: sinks, recent positions, then each pick and its successors (see
    ``attention.reference.sketch_lists``), as slots; the request's end, from its first head."""
    request = tl.program_id(0) // num_kv_heads
    head = tl.program_id(0) % num_kv_heads
    table_row = tl.load(Rows + request).to(tl.int64)
    prefix = tl.load(Prefix + request)
    sinks = tl.load(Sinks + request)
    recent_start = tl.load(RecentStart + request)
    recent = tl.load(Recent + request)
    listed_from = listed_width - tl.load(ListedLengths + request)
    picks_row = request.to(tl.int64) * stride_pn + head * stride_ph
    listed_row = table_row * stride_lr + head * stride_lh
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([], tl.int32)
    for start in range(0, most, BLOCK):
        index = tl.load(Picks + picks_row + start + offs, mask=start + offs < most, other=-1)
        count += tl.sum((index >= 0).to(tl.int32), axis=0)
    end = sinks + recent + count * SPAN
    first_pick = most - count
    out_row = Out + head * stride_oh + request.to(tl.int64) * width
    for start in range(0, width, BLOCK):
        entry = start + offs
        in_picks = entry - sinks - recent
        pick = in_picks // SPAN
        step = in_picks - pick * SPAN
        has_pick = (in_picks >= 0) & (entry < end)
        args = (Picks, Listed, picks_row, listed_row)
        base = _pick_positions(*args, first_pick + pick, has_pick, prefix, sinks, listed_from)
        following = _pick_positions(*args, first_pick + pick + 1, has_pick & (pick + 1 < count), prefix, sinks,
                                    listed_from)  # fmt: skip
        spread = base + step
        kept = (base >= 0) & (spread < recent_start) & ((following < 0) | (spread < following))
        positions = tl.where(entry < sinks, entry, tl.where(in_picks < 0, recent_start + entry - sinks, -1))
        positions = tl.where(has_pick, tl.where(kept, spread, -1), positions)
        positions = tl.where(entry < end, positions, -1)
        slots = tl.load(Table + table_row * stride_tr + tl.maximum(positions, 0), mask=positions >= 0, other=-1)
        tl.store(out_row + entry, slots, mask=entry < width)
    if head == 0:
        tl.store(Ends + request, request.to(tl.int64) * width + end)


def sketch_lists(
    picks: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, listed: torch.Tensor,
    listed_lengths: torch.Tensor, sinks: torch.Tensor, recent_start: torch.Tensor, recent: torch.Tensor, span: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """See :func:`attention.reference.sketch_lists`."""
    num, num_kv_heads, most = picks.shape
    out = torch.empty(num_kv_heads, num * width, dtype=table.dtype, device=picks.device)
    ends = torch.empty(num, dtype=torch.int64, device=picks.device)
    if out.numel() == 0:
        return out, ends.fill_(0)
    picks = picks if picks.stride(-1) == 1 else picks.contiguous()
    _sketch_lists_kernel[(num * num_kv_heads,)](
        picks, table, rows, prefix, listed, listed_lengths, sinks, recent_start, recent, out, ends, picks.stride(0),
        picks.stride(1), table.stride(0), listed.stride(0), listed.stride(1), out.stride(0), num_kv_heads, most,
        listed.shape[-1], width, SPAN=span, BLOCK=LIST_BLOCK,
    )  # fmt: skip
    return out, ends
