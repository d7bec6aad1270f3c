"""Plain-PyTorch reference of every op: the specification the fast kernels are tested against.

The layer ops at the end (RMSNorm, SiLU x mul, rotary embedding with the K/V store) compute exactly what
transformers' Llama-family modules compute, rounding where they round, so a forward fused from them gives the
model's own numbers.

Layout conventions (shared by every implementation of these ops):

- The KV cache of one layer is two tensors ``[num_slots, num_kv_heads, head_dim]`` (page size 1: a slot is
  one physical row holding one token's K or V for all KV heads).
- A packed batch holds ``T`` query tokens of ``B`` requests back to back; ``cu_seqlens_q`` (``[B + 1]``)
  gives each request's query range.
- Each request reads the slots ``kv_indices[..., kv_indptr[b]:kv_indptr[b + 1]]``: one list for all KV
  heads (``kv_indices`` of shape ``[N]``) or one list per KV head (shape ``[num_kv_heads, N]``, equal
  lengths per request; a slot of ``-1`` is padding and is skipped). The last ``q_len`` entries of a
  request's list are its own query tokens in order, which is what the causal mask is relative to
  (query ``i`` of ``q_len`` sees list entries ``j <= len - q_len + i``). A sliding window ``w`` further
  limits query ``i`` to the ``w`` entries ending at its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

#: The op set: every implementation (this module, the Triton ``attention.ops``) provides these functions.
OP_NAMES = (
    "paged_attention",
    "store_kv",
    "rms_norm",
    "silu_and_mul",
    "rotary_store_kv",
    "warped_lse",
    "warped_sample",
    "top_k_positions",
    "store_key_sketch",
    "sketch_mass",
)
#: The verify mass PillarAttn ranks: bf16 keeps ~2-3 significant digits (a Top-K needs no more) over fp32's range
#: (weights relative to the sink span far more than fp16's), and a 16-bit Top-K takes two radix passes where fp32
#: takes four: PillarAttn's Top-K over 23,040 rows x 6.4K (W1 at 6.5K context) is ~4 ms of a round.
MASS_DTYPE = torch.bfloat16
#: A scored query's weight for an entry (see ``paged_attention``) is capped at ``2 ** MASS_MAX_LOG2``: a sum of
#: ``MAX_SCORED_ROWS`` of them stays inside bf16's range (2 ** 128).
MASS_MAX_LOG2 = 120.0
#: The most (scored query, GQA head) rows of one request: the kernel scores them in one tile of rows.
MAX_SCORED_ROWS = 64
#: The largest tensors of one batched pass of the reference attention, its logits or its gathered K and V, hold at most
#: this many elements (64 MiB of fp32): more requests of a shape go in runs.
REFERENCE_CHUNK_ELEMENTS = 1 << 24
LOG2E = 1.4426950408889634
#: The key sketch a query-aware draft scores every cached key on: each key quantised symmetrically to signed 4-bit
#: codes (-7 .. 7, stored + 8: two channels a byte, channel 2i in the low nibble) with one fp32 scale a key and KV
#: head, 36 bytes a key where K takes 128 at head_dim 64.
SKETCH_LEVELS = 7


class FirstLists(NamedTuple):
    """The slot lists of the first ``num_requests`` requests of a batch (e.g. sparse per-head draft lists)
    when they differ from the others', with launch hints of their own."""

    num_requests: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_q_len: int | None = None
    max_kv_len: int | None = None
    #: ``[num_requests]``: request ``b`` reads its list up to ``kv_ends[b]`` instead of ``kv_indptr[b + 1]`` (the
    #: forwards of a draft round read growing prefixes of one list per request).
    kv_ends: torch.Tensor | None = None


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the K/V of ``T`` new tokens (``[T, num_kv_heads, head_dim]``) to their slots (``[T]``)."""
    k_cache.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _visible_mask(q_len: int, kv_lens: torch.Tensor, width: int, sliding_window: int | None) -> torch.Tensor:
    """``[B, q_len, width]`` bool: which list entries each query token of each request (its list ``kv_lens[b]``
    long, padded to ``width``) may attend to."""
    query = torch.arange(q_len, device=kv_lens.device)[None, :, None]
    entry = torch.arange(width, device=kv_lens.device)[None, None, :]
    last_visible = query + (kv_lens - q_len)[:, None, None]
    visible = entry <= last_visible  # entries past a list lie past its last query's
    if sliding_window is not None:
        visible &= entry > last_visible - sliding_window
    return visible


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
    kv_ends: torch.Tensor | None = None,
    live_requests: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a packed batch over per-request slot lists.

    ``query`` is ``[T, num_heads, head_dim]``; query heads ``g * group .. (g + 1) * group - 1`` share KV
    head ``g`` (GQA), computed by broadcasting, never by repeating K/V. Returns the output
    ``[T, num_heads, head_dim]`` in the query's dtype and the log-sum-exp of the scaled logits
    ``[T, num_heads]`` in fp32 (``-inf`` and a zero output for a query that sees no entry).

    ``first_lists``: the first ``first_lists.num_requests`` requests read these lists instead (e.g. sparse
    per-head draft lists next to shared verify lists, one launch in the kernels); ``kv_indptr``/``kv_indices``
    then cover the remaining requests. ``max_q_len``/``max_kv_len`` (of the remaining requests) and the
    ones in ``first_lists`` are launch hints for the kernels (upper bounds), unused here. ``kv_ends`` (``[B]``;
    the first lists' own in ``first_lists``): request ``b``'s list ends there, not at ``kv_indptr[b + 1]``.

    ``mass`` (``[num_kv_heads, R, width]``, ``MASS_DTYPE``) with ``num_scored_queries`` (``[R]``) for the ``R``
    requests that read ``kv_indptr``/``kv_indices``: the verify mass PillarAttn ranks, computed in the same pass
    (the paper's zero-overhead identification). Request ``b``'s last ``num_scored_queries[b]`` query tokens
    (0: none, its row untouched) weigh every entry ``j`` they see by ``exp(logit_j - max(logit_0, logit_last))``:
    its attention probability relative to that of the list's first entry (the sink every full list starts with)
    or of its last (the newest token), whichever is larger, a base that needs no normaliser the pass has not
    finished yet (``2 ** MASS_MAX_LOG2`` at most). Row ``b`` of each KV head gets the
    sum over those queries and the head's GQA group, in list order; entries past the list are left as they were.
    Full lists only (shared, no window). ``max_scored_queries`` bounds the counts (a launch hint); a request's
    scored queries times ``group`` may not exceed ``MAX_SCORED_ROWS``.

    ``live_requests`` (``[2]``): how many of the first lists' requests and of the others' are real, the rest
    padding with empty lists (a CUDA graph's replay of fewer requests than it holds): a hint the kernels split
    the real requests' lists by; here padding requests' tokens get what an empty list gives (zeros, -inf).
    """
    if first_lists is not None:
        num_first, first_indptr, first_indices = first_lists[:3]
        split = int(cu_seqlens_q[num_first])
        first = paged_attention(
            query[:split],
            k_cache,
            v_cache,
            cu_seqlens_q[: num_first + 1],
            first_indptr,
            first_indices,
            scale,
            sliding_window,
            kv_ends=first_lists.kv_ends,
        )
        rest = paged_attention(
            query[split:],
            k_cache,
            v_cache,
            cu_seqlens_q[num_first:] - split,
            kv_indptr,
            kv_indices,
            scale,
            sliding_window,
            mass=mass,
            num_scored_queries=num_scored_queries,
            kv_ends=kv_ends,
        )
        return torch.cat([first[0], rest[0]]), torch.cat([first[1], rest[1]])
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    per_head_lists = kv_indices.dim() == 2
    if mass is not None and (per_head_lists or sliding_window is not None):
        raise ValueError("the verify mass is scored over full lists only (shared by the KV heads, no window)")
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=query.device)
    q_starts, kv_starts = cu_seqlens_q[:-1], kv_indptr[:-1]
    kv_lens = (kv_indptr[1:] if kv_ends is None else kv_ends) - kv_starts
    scored = num_scored_queries.tolist() if mass is not None else None
    q_lens = (cu_seqlens_q[1:] - q_starts).tolist()
    for q_len, count, requests in _runs(q_lens, kv_lens.tolist(), scored, num_heads, 2 * num_kv_heads * head_dim):
        index = torch.tensor(requests, device=query.device)
        run = _Run(index, q_starts[index], kv_starts[index], kv_lens[index], q_len, count)
        _attend(query, k_cache, v_cache, run, kv_indices, scale, sliding_window, out, lse, mass)
    return out.to(query.dtype), lse


class _Run(NamedTuple):
    """Requests of a packed batch attended together (``_runs``)."""

    requests: torch.Tensor  # their indices in the batch
    q_starts: torch.Tensor
    kv_starts: torch.Tensor
    kv_lens: torch.Tensor
    q_len: int  # every request's
    scored: int  # every request's scored queries (0: no mass)


def _runs(
    q_lens: list[int], kv_lens: list[int], scored: list[int] | None, num_heads: int, kv_row: int
) -> Iterator[tuple[int, int, list[int]]]:
    """Requests attended together, as (query count, scored queries, requests): those of the same query count and
    scored queries whose lists are within twice each other's length (lists padded to the longest waste at most
    half a run's work), in runs whose padded logits and gathered K/V (``kv_row`` elements a list entry) stay within
    ``REFERENCE_CHUNK_ELEMENTS``. Requests that see nothing are left out. A run's products pad each request's list,
    so its numbers may differ from its own pass in the last bit, as a GEMM's rows do with the batch."""
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q_len > 0 and kv_len > 0:
            count = min(scored[b], q_len) if scored is not None else 0
            by_shape.setdefault((q_len, count, (kv_len - 1).bit_length()), []).append(b)
    for (q_len, count, width_bits), requests in by_shape.items():
        per_run = max(1, REFERENCE_CHUNK_ELEMENTS // (max(num_heads * q_len, kv_row) << width_bits))
        for first in range(0, len(requests), per_run):
            yield q_len, count, requests[first : first + per_run]


def _attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    run: _Run,
    kv_indices: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    mass: torch.Tensor | None,
) -> None:
    """``paged_attention`` of one run of requests, each list padded to the run's longest (padding masked out):
    its queries' rows of ``out`` and ``lse``, and its rows of ``mass``."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    count, q_len, width = run.requests.shape[0], run.q_len, int(run.kv_lens.max())
    entry = torch.arange(width, device=query.device)
    in_list = entry < run.kv_lens[:, None]  # [B, L]
    at = torch.where(in_list, run.kv_starts[:, None] + entry, run.kv_starts[:, None])  # padding reads an entry
    if kv_indices.dim() == 2:  # a list per KV head, -1 entries padding
        slots = torch.where(in_list[:, None], kv_indices[:, at].transpose(0, 1), -1)  # [B, Hkv, L]
        rows = slots.clamp(min=0), torch.arange(num_kv_heads, device=query.device)[:, None]
        keys, values = k_cache[rows], v_cache[rows]  # [B, Hkv, L, D]
        valid = (slots >= 0)[:, :, None, None, :]  # [B, Hkv, 1, 1, L]
    else:
        slots = kv_indices[at]  # [B, L]
        keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache[slots].transpose(1, 2)
        valid = in_list[:, None, None, None, :]
    tokens = run.q_starts[:, None] + torch.arange(q_len, device=query.device)  # [B, q_len]
    q = query[tokens].float().reshape(count, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)[:, :, None]) * scale  # [B, Hkv, G, q_len, L]
    visible = valid & _visible_mask(q_len, run.kv_lens, width, sliding_window)[:, None, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    request_lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G, q_len]
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows that see nothing give zeros
    request_out = torch.matmul(probs, values.float()[:, :, None])  # [B, Hkv, G, q_len, D]
    out[tokens] = request_out.permute(0, 3, 1, 2, 4).reshape(count, q_len, num_heads, head_dim)
    lse[tokens] = request_lse.permute(0, 3, 1, 2).reshape(count, q_len, num_heads)
    if mass is None or not run.scored:
        return
    scored = slice(q_len - run.scored, q_len)  # each request's last queries
    last = (run.kv_lens - 1)[:, None, None, None].expand(-1, num_kv_heads, 1, head_dim)
    ends = torch.cat([keys[:, :, :1], keys.gather(2, last)], dim=2).float()  # [B, Hkv, 2, D]: first, last entry
    base = (torch.matmul(q[:, :, :, scored], ends[:, :, None].transpose(-1, -2)) * scale).amax(dim=-1, keepdim=True)
    weights = torch.exp2(((logits[:, :, :, scored] - base) * LOG2E).clamp(max=MASS_MAX_LOG2))  # invisible: 0
    summed = weights.sum(dim=(2, 3)).transpose(0, 1).to(mass.dtype)  # [Hkv, B, L]
    kept = mass[:, run.requests, :width]  # entries past a list keep what they held
    mass[:, run.requests, :width] = torch.where(in_list, summed, kept)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` over the last dimension of ``x`` (any leading shape): normalise in fp32,
    round to ``x``'s dtype, then scale by ``weight``."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [..., 2 * I]`` holding gate then up (a fused gate/up projection)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (rotate-half layout) for ``query`` ``[T, H, D]`` and ``key``
    ``[T, Hkv, D]`` with ``cos``/``sin`` ``[T, D]``; returns new contiguous tensors."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos[:, None] + torch.cat((-second, first), dim=-1) * sin[:, None]

    return rotate(query).contiguous(), rotate(key).contiguous()


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
    """The rotary embedding of ``query`` and ``key`` (``[T, H or Hkv, D]``), and ``store_kv`` of the rotated
    keys and ``value``; returns the rotated queries (one kernel on the GPU, where a layer's new K/V never
    exist outside the cache)."""
    query, key = rotary_embedding(query, key, cos, sin)
    store_kv(k_cache, v_cache, key, value, slot_mapping)
    return query


def warped_lse(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """``[R]`` fp32: each row's ``logsumexp`` of ``logits / temperature`` (``[R, V]`` in any float dtype, divided
    in fp32 as transformers' temperature warper does) over the entries at or above its ``cutoff`` (``[R]``, in
    the same scaled units; -inf keeps every entry): the log-normaliser of the temperature- and top-k-warped
    distribution, whose probabilities are then ``exp(scaled - lse)`` on the kept entries."""
    scaled = logits / temperature[:, None].float()
    return scaled.masked_fill(scaled < cutoff[:, None], float("-inf")).logsumexp(dim=-1)


def warped_sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    cutoff: torch.Tensor,
    seed: torch.Tensor,
    lse: torch.Tensor | None = None,
    minus: torch.Tensor | None = None,
    minus_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` int64: a token drawn from each distribution ``rows[i]`` of ``logits`` (``[R, V]``), the softmax of
    ``logits / temperature`` over the entries at or above ``cutoff`` (as ``warped_lse`` keeps them). With
    ``minus`` (``[M, V]``, and ``lse``: each row's ``warped_lse``), draw ``i`` is from that distribution p less
    row ``minus_rows[i]`` of ``minus`` (q; none where it is -1), ``max(p - q, 0)`` normalised: rejection
    sampling's correction after a rejected draft; from p itself where nothing is left (p and q equal up to
    rounding). A Gumbel-max draw: the entry with the largest ``log(weight) + G``, ``G`` standard Gumbel noise,
    one per entry and draw from a generator seeded with ``seed`` (``[1]`` int64; the Triton op draws from
    Philox under it: the same distribution, not the same tokens)."""
    generator = torch.Generator(device=logits.device).manual_seed(int(seed))
    scaled = logits[rows] / temperature[rows, None].float()
    uniform = torch.rand(scaled.shape, generator=generator, device=logits.device)
    noise = -torch.log(-torch.log(uniform))  # uniform 0 gives -inf: never drawn
    kept = scaled >= cutoff[rows, None]
    if minus is None:
        return torch.where(kept, scaled + noise, float("-inf")).argmax(dim=-1)
    probs = torch.where(kept, torch.exp(scaled - lse[rows, None]), 0.0)
    return (residual_weights(probs, minus, minus_rows).log() + noise).argmax(dim=-1)


def residual_weights(probs: torch.Tensor, minus: torch.Tensor, minus_rows: torch.Tensor) -> torch.Tensor:
    """``max(probs - q, 0)`` per row (``probs`` ``[N, V]``; q row ``minus_rows[i]`` of ``minus``, none where it is
    -1), or ``probs`` where that leaves nothing: the weights ``warped_sample`` draws from (unnormalised)."""
    q = torch.where(minus_rows[:, None] >= 0, minus[minus_rows.clamp(min=0)], 0.0)
    residual = (probs - q).clamp(min=0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)


def top_k_positions(
    values: torch.Tensor, k: torch.Tensor, max_k: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., max_k]`` int32: the positions of the ``k`` largest entries of each row of ``values`` (``[..., W]``,
    any float dtype; ``k`` broadcast to its leading dimensions, clamped to ``[0, min(max_k, W)]``) in ascending
    order, after ``max_k - k`` entries of -1. Among entries equal to the k-th largest, the lowest positions are
    taken; -0.0 equals 0.0. The k-th largest value of a row is then the least of its picks. ``lengths`` (broadcast
    like ``k``; None: ``W``): a row's entries from its length on are not read, nor picked (``k`` clamped to it)."""
    width = values.shape[-1]
    lead = values.shape[:-1]
    counts = k.expand(lead).clamp(0, min(max_k, width))[..., None]
    if lengths is not None:
        inside = torch.arange(width, device=values.device) < lengths.expand(lead)[..., None]
        values = values.masked_fill(~inside, float("-inf"))
        counts = torch.minimum(counts, lengths.expand(lead)[..., None])
    out = torch.full((*lead, max_k + 1), -1, dtype=torch.int32, device=values.device)
    if values.numel() == 0 or max_k == 0:
        return out[..., :max_k]
    largest = values.topk(min(max_k, width), dim=-1).values
    kth = largest.gather(-1, (counts - 1).clamp(min=0))
    above = values > kth
    ties = values == kth
    room = counts - above.sum(dim=-1, keepdim=True)
    chosen = (above | (ties & (ties.cumsum(dim=-1) <= room))) & (counts > 0)
    # Each pick's place: after the padding, in position order; the rest go to a spare column, then dropped.
    slot = torch.where(chosen, max_k - counts + chosen.cumsum(dim=-1) - 1, max_k)
    out.scatter_(-1, slot, torch.arange(width, dtype=torch.int32, device=values.device).expand_as(values))
    return out[..., :max_k]


def store_key_sketch(k_cache: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Write the int4 sketch (``SKETCH_LEVELS``) of the keys at ``slots`` (``[T]``) of ``k_cache`` (``[slots, Hkv,
    D]``) into ``codes`` (``[slots, Hkv, D // 2]`` uint8) and ``scales`` (``[slots, Hkv]`` fp32): a key's scale is
    its largest magnitude over ``SKETCH_LEVELS``, its codes each channel over the scale, rounded half to even."""
    keys = k_cache[slots].float()
    largest = keys.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    # By a tensor: by a Python number CUDA multiplies by its reciprocal, a bit off the kernel's IEEE division.
    scale = largest / torch.full_like(largest, SKETCH_LEVELS)
    stored = (keys / scale[..., None]).round().clamp(-SKETCH_LEVELS, SKETCH_LEVELS).to(torch.int32) + 8
    codes[slots] = (stored[..., 0::2] | (stored[..., 1::2] << 4)).to(torch.uint8)
    scales[slots] = scale


def sketch_logits(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[n, Hkv, G, S]`` fp32: each query head's dot product (unscaled) with the sketched keys of its KV head at
    ``slots`` (``[n, Hkv, S]``, each KV head its own), for ``query`` ``[n, Hkv, G, D]`` grouped by KV head."""
    heads = torch.arange(codes.shape[1], device=codes.device)[None, :, None]
    packed = codes[slots, heads].to(torch.int32)  # [n, Hkv, S, D // 2]
    channels = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float() - 8
    keys = channels * scales[slots, heads][..., None]
    return torch.einsum("nhgd,nhsd->nhgs", query.float(), keys)


def group_mass(logits: torch.Tensor, valid: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """``[n, Hkv, S]`` fp32: the attention each entry of a row gets from a GQA group, each query head's softmax of
    ``logits`` (``[n, Hkv, G, S]``, scaled) over the row's ``valid`` entries averaged over the group; -1 for the
    entries not valid and the first ``skip[i]`` of row ``i`` (``[n]``), which weigh in the softmax but are never
    to be picked (a draft's sinks)."""
    logits = logits.float().masked_fill(~valid[:, :, None], float("-inf"))
    mass = logits.softmax(dim=-1).mean(dim=2)
    skipped = torch.arange(logits.shape[-1], device=logits.device) < skip[:, None, None]
    return mass.masked_fill(~valid | skipped, -1.0)


def candidate_positions(
    prefix: torch.Tensor, listed: torch.Tensor, listed_lengths: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The positions of candidates ``index`` (``[n, Hkv, m]``, -1 = none) of rows whose candidates are positions
    0 .. ``prefix[i]`` - 1, then the last ``listed_lengths[i]`` entries of ``listed[rows[i], h]`` (``listed``:
    ``[R, Hkv, L]``, -1 = padding; a Top-K's layout, its picks last): -1 for none, padding and indices past a
    row's candidates."""
    prefix, total = prefix[:, None, None], (prefix + listed_lengths)[:, None, None]
    heads = torch.arange(listed.shape[1], device=index.device)[None, :, None]
    width = listed.shape[-1]
    at = (width - listed_lengths[:, None, None] + index - prefix).clamp(0, max(width - 1, 0))
    from_list = listed[rows[:, None, None], heads, at].long() if width else torch.full_like(index, -1)
    return torch.where((index < 0) | (index >= total), -1, torch.where(index < prefix, index, from_list)).long()


def sketch_mass(
    query: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    prefix: torch.Tensor,
    listed: torch.Tensor,
    listed_lengths: torch.Tensor,
    scale: float,
    skip: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """``[n, Hkv, width]`` fp32: how much of each GQA group's attention a query-aware draft would give each
    candidate position (``group_mass`` of ``scale`` x ``sketch_logits``), read from the int4 sketch. Row ``i``'s
    candidates (``candidate_positions``, ``listed`` by slot-table row as ``table``) sit at slots ``table[rows[i],
    position]``; its first ``skip[i]`` and its
    padding get -1, as do the entries past its candidates (which the Triton kernel leaves unwritten: read the rows
    with ``top_k_positions``' ``lengths``)."""
    num, num_kv_heads = query.shape[:2]
    index = torch.arange(width, device=query.device).expand(num, num_kv_heads, width)
    positions = candidate_positions(prefix, listed, listed_lengths, index, rows)
    slots = torch.where(positions >= 0, table[rows[:, None, None], positions.clamp(min=0)], -1)
    return group_mass(sketch_logits(query, codes, scales, slots.clamp(min=0)) * scale, slots >= 0, skip)


def sketch_lists(
    picks: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    prefix: torch.Tensor,
    listed: torch.Tensor,
    listed_lengths: torch.Tensor,
    sinks: torch.Tensor,
    recent_start: torch.Tensor,
    recent: torch.Tensor,
    span: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A query-aware draft's lists from its picks: the slots ``[Hkv, n x width]`` (-1 = padding) and the end of
    each request's list ``[n]`` (offsets into them). Request ``i``'s list (``width`` entries a KV head) holds its
    first ``sinks[i]`` positions, the ``recent[i]`` positions from ``recent_start[i]``, then each pick with the
    ``span - 1`` positions after it: ``picks`` (``[n, Hkv, P]``, ``top_k_positions``' layout: -1 first, then
    ascending indices) are candidates as ``sketch_mass`` takes them (ascending in position), mapped by
    ``candidate_positions``; a pick among the first ``sinks[i]`` candidates (a sink: never picked) is left out, as
    is a successor at or past ``recent_start[i]`` or the next pick (no position twice). Slots are
    ``table[rows[i], position]``."""
    num, num_kv_heads, most = picks.shape
    count = (picks >= 0).sum(dim=-1)  # [n, Hkv]: the same in every head
    positions = candidate_positions(prefix, listed, listed_lengths, picks.long(), rows)
    positions = torch.where(picks < sinks[:, None, None], -1, positions)
    following = torch.cat([positions[..., 1:], torch.full_like(positions[..., :1], -1)], dim=-1)
    steps = torch.arange(span, device=picks.device)
    spread = positions[..., None] + steps  # [n, Hkv, P, span]
    kept = (positions[..., None] >= 0) & (spread < recent_start[:, None, None, None])
    kept &= (following[..., None] < 0) | (spread < following[..., None])
    spread = torch.where(kept, spread, -1).flatten(-2)  # the picks' region: compacted picks start at P - count
    entry = torch.arange(width, device=picks.device)[None, None, :]
    sinks_, recent_ = sinks[:, None, None], recent[:, None, None]
    in_picks = entry - sinks_ - recent_
    from_picks = ((most - count[..., None]) * span + in_picks).clamp(0, max(most * span - 1, 0))
    picked = spread.gather(-1, from_picks) if most else torch.full_like(from_picks, -1)
    ends = sinks + recent + count[:, 0] * span if most else sinks + recent
    list_positions = torch.where(
        entry < sinks_,
        entry,
        torch.where(in_picks < 0, recent_start[:, None, None] + entry - sinks_, picked),
    )
    list_positions = torch.where(entry < ends[:, None, None], list_positions, -1)
    slots = torch.where(list_positions >= 0, table[rows[:, None, None], list_positions.clamp(min=0)], -1)
    starts = torch.arange(num, device=picks.device) * width
    return slots.transpose(0, 1).reshape(num_kv_heads, num * width), starts + ends
