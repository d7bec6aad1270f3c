"""Triton kernel: the positions of each row's k largest values, in ascending order.

Three Top-Ks run in every round: the vocabulary's top-k cut-off of the verify's rows, the top-k support each draft
samples over, and PillarAttn's pick of the most attended positions. ``torch.topk`` (then a sort of the picks) costs
the H200 ~0.9 ms for the verify's 2,304 x 49,152 logits and ~1.9 ms for PillarAttn's 23,040 rows at 4.2K context.

Values map to unsigned keys that order as the values do; the k-th largest key comes from a binary search over its
bits, each step one count of the keys at or above a candidate. A row that fits one block is searched in registers.
A longer row is read once for the maxima of its lanes: the k-th largest of those is a lower bound on the row's, and
the few entries at or above it are gathered (one more read) and searched; a row with too many of them (ties, a
flat row), or more than half a block of picks, is searched over its whole length a digit (8 bits) at a time, one
read and histogram per digit (4 reads for fp32 where a search by bits reads the row 32 times). Then the
positions of the keys above the k-th largest and of the ties it still needs, lowest first, are written in one
scan: already in ascending order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Row entries per iteration of a row's loops, and the widest row searched in registers alone. On the H200, 1,024
# with 4 warps took W1's verify cut-off from 0.57 ms (4,096 with 8 warps) to 0.46, and PillarAttn's picks at 4.2K
# context from 3.3 ms (8,192-wide rows in registers) to 0.8: many small programs hide the serial reductions of a
# binary search better than a few wide ones (benchmarks/select_micro.py).
BLOCK = 1024
CANDIDATES = 4  # a long row gathers room for this many times max_k entries at or above its bound
DIGIT_BITS: tl.constexpr = tl.constexpr(8)  # bits of a key the k-th largest's search settles per count
DIGITS: tl.constexpr = tl.constexpr(256)


@triton.jit
def _keys(values, valid, KEY_BITS: tl.constexpr):
    """Unsigned keys that order as ``values`` do (-0.0 taken as 0.0); 0 where not ``valid``, below any value."""
    if KEY_BITS == 16:
        bits = values.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = tl.where(bits == 0x8000, 0, bits)
        keys = tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000).to(tl.uint32)
    else:
        bits = values.to(tl.uint32, bitcast=True)
        bits = tl.where(bits == 0x80000000, 0, bits)
        keys = tl.where(bits >= 0x80000000, ~bits, bits | 0x80000000)
    return tl.where(valid, keys, 0)


@triton.jit
def _load_keys(Values, row_offset, cols, width, KEY_BITS: tl.constexpr):
    in_row = cols < width
    values = tl.load(Values + row_offset + cols, mask=in_row, other=0.0)
    return _keys(values, in_row, KEY_BITS), in_row


@triton.jit
def _digit_counts(keys, kth, shift: tl.constexpr):
    """How many ``keys`` hold each value of the digit at ``shift``, among those whose digits above it are
    ``kth``'s."""
    same_above = ((keys >> shift) >> DIGIT_BITS) == ((kth >> shift) >> DIGIT_BITS)
    return tl.histogram(((keys >> shift) & (DIGITS - 1)).to(tl.int32), DIGITS, mask=same_above)


@triton.jit
def _choose_digit(counts, kth, need, shift: tl.constexpr):
    """The k-th largest key's digit at ``shift`` from the counts of the keys that still compete
    (``_digit_counts``): the largest digit with at least ``need`` of them at or above it, set in ``kth``; and how
    many of the k are still needed below the keys of higher digits."""
    digits = tl.arange(0, DIGITS)
    at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
    digit = tl.max(tl.where(at_or_above >= need, digits, 0), axis=0)
    above = tl.sum(tl.where(digits > digit, counts, 0), axis=0)
    return kth | (digit.to(tl.uint32) << shift), need - above


@triton.jit
def _kth_largest(keys, k, KEY_BITS: tl.constexpr):
    """The largest key ``t`` with at least ``k`` of ``keys`` at or above it (all ones for k = 0), a bit at a time:
    in registers a count is one reduction, cheaper than a histogram (the H200's PillarAttn picks at 4.2K context
    took 0.75 ms by bits, 1.01 by digits)."""
    kth = tl.zeros([], tl.uint32)
    one = tl.full([], 1, tl.uint32)
    for bit in tl.static_range(KEY_BITS):
        candidate = kth | (one << (KEY_BITS - 1 - bit))
        count = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        kth = tl.where(count >= k, candidate, kth)
    return kth


@triton.jit
def _write_chosen(Out, out_offset, pad, keys, positions, valid, kth, remaining, taken, ties):
    """Store the positions of the keys above ``kth`` and of the ties to it while ``remaining`` allow (in the order
    given: ascending), after ``pad + taken`` entries of the row; returns the updated counts."""
    tie = valid & (keys == kth)
    tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
    chosen = (valid & (keys > kth)) | (tie & (tie_rank < remaining))
    slot = pad + taken + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(Out + out_offset + slot, positions.to(Out.dtype.element_ty), mask=chosen)
    return taken + tl.sum(chosen.to(tl.int32), axis=0), ties + tl.sum(tie.to(tl.int32), axis=0)


@triton.jit
def _write_by_whole_row(Values, Out, row_offset, out_offset, pad, k, length, offs, KEY_BITS: tl.constexpr,
                        BLOCK: tl.constexpr):  # fmt: skip
    """A row's picks from a search over its whole length, one read per digit (a query sketch's shortlist of ~1,400
    from ~4,400 positions: 0.22 -> 0.16 ms on the H200 against one read per bit), then one to count the keys above
    the k-th largest and one to write."""
    zero = tl.zeros([], tl.int32)
    kth = tl.zeros([], tl.uint32)
    need = k
    for digit in tl.static_range(KEY_BITS // DIGIT_BITS):
        shift = KEY_BITS - DIGIT_BITS * (digit + 1)
        counts = tl.zeros([DIGITS], tl.int32)
        for start in range(0, length, BLOCK):
            keys, _ = _load_keys(Values, row_offset, start + offs, length, KEY_BITS)
            counts += _digit_counts(keys, kth, shift)
        kth, need = _choose_digit(counts, kth, need, shift)
    above = zero
    for start in range(0, length, BLOCK):
        keys, _ = _load_keys(Values, row_offset, start + offs, length, KEY_BITS)
        above += tl.sum((keys > kth).to(tl.int32), axis=0)
    taken, ties = zero, zero
    for start in range(0, length, BLOCK):
        keys, in_row = _load_keys(Values, row_offset, start + offs, length, KEY_BITS)
        taken, ties = _write_chosen(Out, out_offset, pad, keys, start + offs, in_row, kth, k - above, taken, ties)


# One variant per layout: k and lengths are read one a row (rows of a larger tensor: any alignment).
@triton.jit(
    do_not_specialize=["k_group", "k_period", "stride_k", "group_rows", "stride_group", "stride_row", "width", "max_k"],
    do_not_specialize_on_alignment=["K", "Lengths"],
)
def _top_k_kernel(
    Values,
    K,
    Lengths,
    Out,
    Gathered,
    k_group,
    k_period,
    stride_k,
    group_rows,
    stride_group,
    stride_row,
    width,
    max_k,
    HAS_LENGTHS: tl.constexpr,
    KEY_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    FITS: tl.constexpr,
    WHOLE: tl.constexpr,
    CAP: tl.constexpr,
):
    """One row: ``max_k - k`` entries of -1, then the positions of its ``k`` largest values in ascending order
    (ties to the k-th largest: the lowest positions). Rows are ``width`` apart, their picks ``max_k``; row ``r``
    takes ``K[(r // k_group) % k_period]`` (k broadcast over the leading dimensions), clamped to ``[0, min(max_k,
    width)]``; with ``HAS_LENGTHS`` it reads only the first ``Lengths[...]`` entries (the same index)."""
    row = tl.program_id(0)
    k_at = ((row // k_group) % k_period) * stride_k
    k = tl.load(K + k_at).to(tl.int32)
    row_offset = (row // group_rows).to(tl.int64) * stride_group + (row % group_rows).to(tl.int64) * stride_row
    length = width  # entries read
    if HAS_LENGTHS:
        length = tl.minimum(width, tl.load(Lengths + k_at).to(tl.int32))
    k = tl.minimum(tl.maximum(k, 0), tl.minimum(max_k, length))
    out_offset = row.to(tl.int64) * max_k
    offs = tl.arange(0, BLOCK)
    pad = max_k - k
    for start in range(0, pad, BLOCK):
        tl.store(Out + out_offset + start + offs, -1, mask=start + offs < pad)
    zero = tl.zeros([], tl.int32)
    if FITS:
        keys, in_row = _load_keys(Values, row_offset, offs, length, KEY_BITS)
        kth = _kth_largest(keys, k, KEY_BITS)
        above = tl.sum((keys > kth).to(tl.int32), axis=0)
        _write_chosen(Out, out_offset, pad, keys, offs, in_row, kth, k - above, zero, zero)
    elif WHOLE:  # more picks than lanes: no bound from the lane maxima
        _write_by_whole_row(Values, Out, row_offset, out_offset, pad, k, length, offs, KEY_BITS, BLOCK)
    else:
        lane_max = tl.zeros([BLOCK], tl.uint32)
        for start in range(0, length, BLOCK):
            keys, _ = _load_keys(Values, row_offset, start + offs, length, KEY_BITS)
            lane_max = tl.maximum(lane_max, keys)
        bound = _kth_largest(lane_max, k, KEY_BITS)  # lane maxima are row entries: at most the row's k-th largest
        gathered_offset = row.to(tl.int64) * CAP
        count = zero
        for start in range(0, length, BLOCK):
            keys, in_row = _load_keys(Values, row_offset, start + offs, length, KEY_BITS)
            candidate = in_row & (keys >= bound)
            slot = count + tl.cumsum(candidate.to(tl.int32), axis=0) - 1
            tl.store(Gathered + gathered_offset + slot, start + offs, mask=candidate & (slot < CAP))
            count += tl.sum(candidate.to(tl.int32), axis=0)
        if count <= CAP:
            index = tl.arange(0, CAP)
            valid = index < count
            positions = tl.load(Gathered + gathered_offset + index, mask=valid, other=0)
            keys = _keys(tl.load(Values + row_offset + positions, mask=valid, other=0.0), valid, KEY_BITS)
            kth = _kth_largest(keys, k, KEY_BITS)
            above = tl.sum((keys > kth).to(tl.int32), axis=0)
            _write_chosen(Out, out_offset, pad, keys, positions, valid, kth, k - above, zero, zero)
        else:  # too many entries at the bound: search the whole row
            _write_by_whole_row(Values, Out, row_offset, out_offset, pad, k, length, offs, KEY_BITS, BLOCK)


def top_k_positions(
    values: torch.Tensor, k: torch.Tensor, max_k: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """See :func:`attention.reference.top_k_positions`."""
    *lead, width = values.shape
    rows = values.numel() // max(width, 1)
    out = torch.empty(*lead, max_k, dtype=torch.int32, device=values.device)
    if rows == 0 or max_k == 0:
        return out
    strides = _row_strides(values)
    if strides is None:  # rows two strides cannot find: a contiguous copy, whose rows they can
        values = values.contiguous()
        strides = _row_strides(values)
    block = BLOCK
    fits = width <= block
    # Thousands of picks a row (a drained batch's drafts read most of their contexts; a query sketch's shortlist):
    # the lane maxima (twice the picks needed) bound nothing, and a block per power of two compiled a variant each
    # (4-7 s, mid-run on W1): the whole row is searched.
    whole = not fits and 2 * max_k > block
    cap = block // 4 if CANDIDATES * max_k <= block // 4 else block  # room for the candidates, in two sizes
    gathered = torch.empty(0 if fits or whole else rows * cap, dtype=torch.int32, device=values.device)
    # k broadcast over the leading dimensions is read in place where it can be: a vector over the last one (or
    # all of them), or one k for each row of the others (``[..., 1]``: one per request over its KV heads); lengths
    # take k's layout.
    k_group, counts = 1, k
    if k.dim() == len(lead) > 1 and k.shape[-1] == 1 and k.shape[:-1] == tuple(lead[:-1]):
        k_group, counts = lead[-1], k.reshape(-1)
        lengths = None if lengths is None else lengths.expand_as(k).reshape(-1)
    elif k.dim() > 1 or lengths is not None:
        counts = k.expand(lead).reshape(-1)
        lengths = None if lengths is None else lengths.expand(lead).reshape(-1)
    _top_k_kernel[(rows,)](
        values,
        counts,
        counts if lengths is None else lengths,
        out,
        gathered,
        k_group,
        counts.numel(),
        counts.stride(0) if counts.dim() else 0,
        *strides,
        width,
        max_k,
        HAS_LENGTHS=lengths is not None,
        KEY_BITS=8 * values.element_size(),
        BLOCK=block,
        FITS=fits,
        WHOLE=whole,
        CAP=cap,
        num_warps=max(1, min(4, block // 256)),
    )
    return out


def _row_strides(values: torch.Tensor) -> tuple[int, int, int] | None:
    """How the kernel finds the rows of ``values`` in place: ``(group_rows, stride_group, stride_row)``, the rows
    of its last leading dimension evenly spaced and the groups of them too, each row unit-stride (a contiguous
    tensor, or any slice of rows and leading columns of one, as PillarAttn's candidates are of the verify mass: no
    copy of 30 x 3 x 256 x 7K scores); None when they cannot be (the caller copies them first)."""
    width = values.shape[-1]
    group_rows = values.shape[-2] if values.dim() > 1 else 1
    try:
        groups = values.view(-1, group_rows, width)
    except RuntimeError:  # leading dimensions that do not merge into evenly spaced groups
        return None
    if groups.stride(2) != 1 and width > 1:
        return None
    return group_rows, groups.stride(0), groups.stride(1)
