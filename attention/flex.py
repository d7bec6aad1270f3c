"""FlexAttention for prefill chunks over the paged pool: the block mask is built from the slot lists.

A prefill step's requests (chunks of their prompts) read their whole slot lists: gathered once per layer into
a packed ``[1, Hkv, N, D]`` K/V, they are one FlexAttention call with a document mask (a query sees the
entries of its own request up to its own position, and within the sliding window if any), so the masked
blocks are skipped and GQA is handled by FlexAttention itself. Same arguments and results as
:func:`attention.reference.paged_attention` for requests without ``first_lists`` (sparse draft lists are the
Triton kernel's job). On CUDA the call is compiled once (dynamic shapes); elsewhere it runs eagerly.
"""

from __future__ import annotations

import functools
from types import ModuleType, SimpleNamespace

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from attention.reference import OP_NAMES

BLOCK_SIZE = 128  # FlexAttention's default tile on the GPU
MIN_QUERY_LEN = 64  # requests with longer queries than this (prefill chunks) make a step FlexAttention's
_last_mask: tuple[tuple[object, ...], BlockMask] | None = None  # (the step's metadata tensors, their mask)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=True)


def _block_mask(
    cu_seqlens_q: torch.Tensor, kv_indptr: torch.Tensor, sliding_window: int | None, num_tokens: int, num_entries: int
) -> BlockMask:
    """Document mask of a packed prefill batch: query i of request r (``q_len`` queries over ``kv_len`` list
    entries) sees the entries j of request r with ``j <= kv_len - q_len + i`` (and ``> that - window``).

    Built once per step (every layer of a step passes the same metadata tensors) and straight from the packing,
    on the device: requests are contiguous in both the queries and the entries, so the entries a query tile
    can see are one run of KV tiles, from the first visible entry of its first query's request to the last
    visible entry of its last query. Tiles where every query sees every entry are listed as full (FlexAttention
    skips ``mask_mod`` there); ``mask_mod`` runs only on the partial ones, never over a dense ``tokens x
    entries`` grid (``create_block_mask`` evaluates that: minutes at 64K x 64K)."""
    global _last_mask
    key = (cu_seqlens_q, kv_indptr, sliding_window)
    if _last_mask is not None and all(a is b for a, b in zip(_last_mask[0], key, strict=True)):
        return _last_mask[1]
    device = cu_seqlens_q.device
    q_len = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    kv_len = kv_indptr[1:] - kv_indptr[:-1]
    requests = torch.arange(q_len.shape[0], device=device)
    q_request = torch.repeat_interleave(requests, q_len, output_size=num_tokens)
    kv_request = torch.repeat_interleave(requests, kv_len, output_size=num_entries)
    q_visible = torch.arange(num_tokens, device=device) - cu_seqlens_q[q_request] + (kv_len - q_len)[q_request]
    kv_position = torch.arange(num_entries, device=device) - kv_indptr[kv_request]

    def visible(batch, head, q_index, kv_index):
        seen = (q_request[q_index] == kv_request[kv_index]) & (kv_position[kv_index] <= q_visible[q_index])
        if sliding_window is not None:
            seen = seen & (kv_position[kv_index] > q_visible[q_index] - sliding_window)
        return seen

    first_query = torch.arange(0, num_tokens, BLOCK_SIZE, device=device)
    last_query = (first_query + BLOCK_SIZE - 1).clamp(max=num_tokens - 1)
    first_entry = kv_indptr[q_request[first_query]]
    if sliding_window is not None:
        first_entry = first_entry + (q_visible[first_query] - sliding_window + 1).clamp(min=0)
    last_entry = kv_indptr[q_request[last_query]] + q_visible[last_query]
    first_tile, last_tile = first_entry // BLOCK_SIZE, last_entry // BLOCK_SIZE
    # Full tiles skip mask_mod: the query tile holds one request's queries and every one of them sees every
    # entry of the KV tile (from the latest lower bound to the earliest upper bound of the tile's queries).
    request_start = kv_indptr[q_request[first_query]]
    seen_by_all_from = request_start
    if sliding_window is not None:
        seen_by_all_from = seen_by_all_from + (q_visible[last_query] - sliding_window + 1).clamp(min=0)
    seen_by_all_to = request_start + q_visible[first_query]  # inclusive
    first_full = -(-seen_by_all_from // BLOCK_SIZE)
    one_request = q_request[first_query] == q_request[last_query]
    num_full = torch.where(one_request, ((seen_by_all_to + 1) // BLOCK_SIZE - first_full).clamp(min=0), 0)
    # Partial tiles: the run first_tile..last_tile without the full ones (a run on each side of them).
    listed = last_tile - first_tile + 1
    left = torch.where(num_full > 0, first_full - first_tile, listed)
    right_start = first_full + num_full
    num_partial = left + torch.where(num_full > 0, last_tile - right_start + 1, 0)
    num_tiles = -(-num_entries // BLOCK_SIZE)
    offsets = torch.arange(num_tiles, device=device)
    partial = torch.where(
        offsets < left[:, None], first_tile[:, None] + offsets, right_start[:, None] + offsets - left[:, None]
    )
    full = first_full[:, None] + offsets
    as_blocks = lambda tensor: tensor.clamp(max=num_tiles - 1).to(torch.int32)[None, None]  # noqa: E731
    mask = BlockMask.from_kv_blocks(
        num_partial.to(torch.int32)[None, None],
        as_blocks(partial),
        num_full.to(torch.int32)[None, None],
        as_blocks(full),
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=visible,
        seq_lengths=(num_tokens, num_entries),
        compute_q_blocks=False,  # inference: no backward pass needs the transposed structure
    )
    _last_mask = (key, mask)
    return mask


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    **hints: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` ``[T, H, D]`` of a packed prefill batch over shared slot lists; returns ``[T, H, D]`` and the
    LSE ``[T, H]`` (natural log), as the reference. Launch hints of the other backends are accepted and not
    needed."""
    if hints.get("first_lists") is not None or hints.get("kv_ends") is not None:
        raise ValueError("FlexAttention serves whole shared lists; draft lists and list ends are the Triton kernel's")
    num_tokens, num_entries = query.shape[0], kv_indices.shape[0]
    if num_tokens == 0 or num_entries == 0:
        return torch.zeros_like(query), query.new_full(query.shape[:2], float("-inf"), dtype=torch.float32)
    keys = k_cache[kv_indices].transpose(0, 1)[None]  # [1, Hkv, N, D]
    values = v_cache[kv_indices].transpose(0, 1)[None]
    mask = _block_mask(cu_seqlens_q, kv_indptr, sliding_window, num_tokens, num_entries)
    attend = _compiled_flex() if query.is_cuda else flex_attention
    out, aux = attend(
        query.transpose(0, 1)[None], keys, values, block_mask=mask, scale=scale, enable_gqa=True,
        return_aux=AuxRequest(lse=True),
    )  # fmt: skip
    return out[0].transpose(0, 1).contiguous(), aux.lse[0].transpose(0, 1).float().contiguous()


def with_flex_prefill(base: ModuleType) -> SimpleNamespace:
    """The op set of ``base`` (Triton on CUDA, the reference elsewhere) with FlexAttention for steps whose
    longest query is a prefill chunk (over ``MIN_QUERY_LEN`` tokens) and that carry no per-head draft lists and no
    list ends."""

    def paged_attention(*arrays: torch.Tensor | float | int | None, **hints: object):
        whole_lists = hints.get("first_lists") is None and hints.get("kv_ends") is None
        prefill = whole_lists and (hints.get("max_q_len") or 0) > MIN_QUERY_LEN
        return (prefill_attention if prefill else base.paged_attention)(*arrays, **hints)

    return SimpleNamespace(**{name: getattr(base, name) for name in OP_NAMES} | {"paged_attention": paged_attention})
