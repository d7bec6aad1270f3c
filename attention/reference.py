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

import itertools
from typing import NamedTuple

import torch

#: The op set: every implementation (this module, the Triton ``attention.ops``) provides these functions.
OP_NAMES = (
    "paged_attention",
    "attention_mass",
    "store_kv",
    "rms_norm",
    "silu_and_mul",
    "rotary_store_kv",
    "warped_lse",
    "top_k_positions",
)
#: The verify mass PillarAttn ranks: fp16 keeps ~3 significant digits of each probability (a Top-K of
#: averaged probabilities needs no more; below 6e-8 a mass becomes 0), and a 16-bit Top-K takes two radix passes
#: where fp32 takes four: PillarAttn's Top-K over 23,040 rows x 6.4K (W1 at 6.5K context) is ~4 ms of a round.
MASS_DTYPE = torch.float16


class FirstLists(NamedTuple):
    """The slot lists of the first ``num_requests`` requests of a batch (e.g. sparse per-head draft lists)
    when they differ from the others', with launch hints of their own."""

    num_requests: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_q_len: int | None = None
    max_kv_len: int | None = None


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


def _visible_mask(q_len: int, kv_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """``[q_len, kv_len]`` bool: which list entries each query token of a request may attend to."""
    last_visible = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    entry = torch.arange(kv_len, device=device)[None, :]
    visible = entry <= last_visible
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a packed batch over per-request slot lists.

    ``query`` is ``[T, num_heads, head_dim]``; query heads ``g * group .. (g + 1) * group - 1`` share KV
    head ``g`` (GQA), computed by broadcasting, never by repeating K/V. Returns the output
    ``[T, num_heads, head_dim]`` in the query's dtype and the log-sum-exp of the scaled logits
    ``[T, num_heads]`` in fp32 (``-inf`` and a zero output for a query that sees no entry).

    ``first_lists``: the first ``first_lists.num_requests`` requests read these lists instead (e.g. sparse
    per-head draft lists next to shared verify lists, one launch in the kernels); ``kv_indptr``/``kv_indices``
    then cover the remaining requests. ``max_q_len``/``max_kv_len`` (of the remaining requests) and the
    ones in ``first_lists`` are launch hints for the kernels (upper bounds), unused here.
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
        )
        return torch.cat([first[0], rest[0]]), torch.cat([first[1], rest[1]])
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    per_head_lists = kv_indices.dim() == 2
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=query.device)
    q_bounds = cu_seqlens_q.tolist()
    kv_bounds = kv_indptr.tolist()
    kv_head_index = torch.arange(num_kv_heads, device=query.device)[:, None]
    for b in range(len(q_bounds) - 1):
        q_start, q_end = q_bounds[b], q_bounds[b + 1]
        kv_start, kv_end = kv_bounds[b], kv_bounds[b + 1]
        q_len, kv_len = q_end - q_start, kv_end - kv_start
        if q_len == 0 or kv_len == 0:
            continue
        if per_head_lists:
            slots = kv_indices[:, kv_start:kv_end]  # [Hkv, L]
            keys = k_cache[slots.clamp(min=0), kv_head_index]  # [Hkv, L, D]
            values = v_cache[slots.clamp(min=0), kv_head_index]
            valid = (slots >= 0)[:, None, None, :]  # [Hkv, 1, 1, L]
        else:
            slots = kv_indices[kv_start:kv_end]
            keys = k_cache[slots].transpose(0, 1)  # [Hkv, L, D]
            values = v_cache[slots].transpose(0, 1)
            valid = torch.ones(1, 1, 1, kv_len, dtype=torch.bool, device=query.device)
        q = query[q_start:q_end].float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        logits = torch.matmul(q, keys.float().transpose(-1, -2)[:, None]) * scale  # [Hkv, G, q_len, L]
        visible = valid & _visible_mask(q_len, kv_len, sliding_window, query.device)
        logits = logits.masked_fill(~visible, float("-inf"))
        request_lse = torch.logsumexp(logits, dim=-1)  # [Hkv, G, q_len]
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows that see nothing give zeros
        request_out = torch.matmul(probs, values.float()[:, None])  # [Hkv, G, q_len, D]
        out[q_start:q_end] = request_out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
        lse[q_start:q_end] = request_lse.permute(2, 0, 1).reshape(q_len, num_heads)
    return out.to(query.dtype), lse


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention probability of every list entry, averaged over queries and each GQA group's heads.

    For request ``b`` the last ``num_scored_queries[b]`` query tokens are scored (0 = not scored, its
    entries stay 0); probabilities are rematerialised from the logits and the ``lse`` the attention pass
    returned, ``exp(q.k * scale - lse)``, with the same causal mask. Shared lists only (``kv_indices`` of
    shape ``[N]``). Returns ``[num_kv_heads, requests, width]`` in ``MASS_DTYPE``: row ``b`` holds the mass of request
    ``b``'s list entries in list order, zeros past its list. ``width`` is ``max_kv_len`` (at least every list's
    length; None: the longest), so a reader takes a Top-K per request without regrouping a flat list.
    ``max_scored`` is a launch hint for the kernels, unused here. ``out``: where to write it (zeroed first; its
    width is the width; the engine gives each layer its slab of one buffer, which the draft policy then reads in
    place); None: a new one.
    """
    num_kv_heads = k_cache.shape[1]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    q_bounds, kv_bounds, scored = cu_seqlens_q.tolist(), kv_indptr.tolist(), num_scored_queries.tolist()
    lengths = [end - start for start, end in itertools.pairwise(kv_bounds)]
    width = out.shape[-1] if out is not None else max_kv_len if max_kv_len is not None else max(lengths, default=0)
    if max(lengths, default=0) > width:  # the Triton kernel would write past its row (it cannot check)
        raise ValueError(f"max_kv_len={width} is shorter than the longest list ({max(lengths)} entries)")
    mass = out if out is not None else query.new_empty(num_kv_heads, len(lengths), width, dtype=MASS_DTYPE)
    mass.zero_()
    for b in range(len(q_bounds) - 1):
        if scored[b] == 0:
            continue
        q_end, kv_start, kv_end = q_bounds[b + 1], kv_bounds[b], kv_bounds[b + 1]
        q_len, kv_len = q_end - q_bounds[b], kv_end - kv_start
        count = min(scored[b], q_len)
        keys = k_cache[kv_indices[kv_start:kv_end]].transpose(0, 1).float()  # [Hkv, L, D]
        q = query[q_end - count : q_end].float().reshape(count, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        logits = torch.matmul(q, keys.transpose(-1, -2)[:, None]) * scale  # [Hkv, G, count, L]
        visible = _visible_mask(q_len, kv_len, None, query.device)[q_len - count :]
        row_lse = lse[q_end - count : q_end].reshape(count, num_kv_heads, group).permute(1, 2, 0)[..., None]
        probs = torch.exp(logits - row_lse).masked_fill(~visible, 0.0)
        mass[:, b, :kv_len] = probs.mean(dim=(1, 2))
    return mass


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


def top_k_positions(values: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """``[..., max_k]`` int32: the positions of the ``k`` largest entries of each row of ``values`` (``[..., W]``,
    any float dtype; ``k`` broadcast to its leading dimensions, clamped to ``[0, min(max_k, W)]``) in ascending
    order, after ``max_k - k`` entries of -1. Among entries equal to the k-th largest, the lowest positions are
    taken; -0.0 equals 0.0. The k-th largest value of a row is then the least of its picks."""
    width = values.shape[-1]
    counts = k.expand(values.shape[:-1]).clamp(0, min(max_k, width))[..., None]
    out = torch.full((*values.shape[:-1], max_k + 1), -1, dtype=torch.int32, device=values.device)
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
