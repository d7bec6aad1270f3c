"""The Triton op set as ``torch.library`` custom ops with fake implementations.

torch.compile treats each op as opaque (no graph breaks, no tracing into Triton launches) and infers output
shapes from the fake implementations. The module has the same functions as
:mod:`attention.reference`, so the engine swaps one for the other.
"""

from __future__ import annotations

import torch

from attention import layer_kernels, logits_kernels, paged, select_kernels, sketch_kernels
from attention.reference import OP_NAMES, FirstLists
from attention.reference import store_kv as store_kv  # a plain index copy: no kernel of its own

__all__ = list(OP_NAMES)


@torch.library.custom_op("torchspec::paged_attention", mutates_args=("mass",))
def _paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_q_len: int | None,
    max_kv_len: int | None,
    num_first: int,
    first_indptr: torch.Tensor | None,
    first_indices: torch.Tensor | None,
    first_max_q_len: int | None,
    first_max_kv_len: int | None,
    first_ends: torch.Tensor | None,
    mass: torch.Tensor | None,
    num_scored_queries: torch.Tensor | None,
    max_scored_queries: int | None,
    kv_ends: torch.Tensor | None,
    live_requests: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    first_lists = (
        FirstLists(num_first, first_indptr, first_indices, first_max_q_len, first_max_kv_len, first_ends)
        if num_first
        else None
    )
    return paged.paged_attention(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        kv_indptr,
        kv_indices,
        scale,
        sliding_window,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        first_lists=first_lists,
        mass=mass,
        num_scored_queries=num_scored_queries,
        max_scored_queries=max_scored_queries,
        kv_ends=kv_ends,
        live_requests=live_requests,
    )


@_paged_attention.register_fake
def _(query, k_cache, v_cache, cu_seqlens_q, kv_indptr, kv_indices, scale, sliding_window, *args):
    return torch.empty_like(query), query.new_empty(query.shape[:2], dtype=torch.float32)


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
    """See :func:`attention.reference.paged_attention`; the keyword hints spare the kernel a device sync."""
    first = first_lists if first_lists is not None else FirstLists(0, None, None)
    return _paged_attention(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        kv_indptr,
        kv_indices,
        scale,
        sliding_window,
        max_q_len,
        max_kv_len,
        *first,
        mass,
        num_scored_queries,
        max_scored_queries,
        kv_ends,
        live_requests,
    )


@torch.library.custom_op("torchspec::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See :func:`attention.reference.rms_norm`."""
    return layer_kernels.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op("torchspec::silu_and_mul", mutates_args=())
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`attention.reference.silu_and_mul`."""
    return layer_kernels.silu_and_mul(gate_up)


@silu_and_mul.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


# The kernel's own signature is the op's schema (the engine swaps this module for the reference one).
rotary_store_kv = torch.library.custom_op("torchspec::rotary_store_kv", mutates_args=("k_cache", "v_cache"))(
    layer_kernels.rotary_store_kv
)


@rotary_store_kv.register_fake
def _(query, key, value, cos, sin, k_cache, v_cache, slot_mapping):
    return query.new_empty(query.shape)


@torch.library.custom_op("torchspec::warped_lse", mutates_args=())
def warped_lse(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """See :func:`attention.reference.warped_lse`."""
    return logits_kernels.warped_lse(logits, temperature, cutoff)


@warped_lse.register_fake
def _(logits, temperature, cutoff):
    return logits.new_empty(logits.shape[:1], dtype=torch.float32)


# The kernel's own signature is the op's schema.
warped_sample = torch.library.custom_op("torchspec::warped_sample", mutates_args=())(logits_kernels.warped_sample)


@warped_sample.register_fake
def _(logits, rows, temperature, cutoff, seed, lse=None, minus=None, minus_rows=None):
    return rows.new_empty(rows.shape, dtype=torch.int64)


@torch.library.custom_op("torchspec::top_k_positions", mutates_args=())
def top_k_positions(
    values: torch.Tensor, k: torch.Tensor, max_k: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """See :func:`attention.reference.top_k_positions`."""
    return select_kernels.top_k_positions(values, k, max_k, lengths)


@top_k_positions.register_fake
def _(values, k, max_k, lengths=None):
    return values.new_empty(*values.shape[:-1], max_k, dtype=torch.int32)


# The kernels' own signatures are the ops' schemas.
store_key_sketch = torch.library.custom_op("torchspec::store_key_sketch", mutates_args=("codes", "scales"))(
    sketch_kernels.store_key_sketch
)


sketch_mass = torch.library.custom_op("torchspec::sketch_mass", mutates_args=())(sketch_kernels.sketch_mass)


@sketch_mass.register_fake
def _(query, codes, scales, table, rows, prefix, listed, listed_lengths, scale, skip, width):
    return query.new_empty(*query.shape[:2], width, dtype=torch.float32)


sketch_lists = torch.library.custom_op("torchspec::sketch_lists", mutates_args=())(sketch_kernels.sketch_lists)


@sketch_lists.register_fake
def _(picks, table, rows, prefix, listed, listed_lengths, sinks, recent_start, recent, span, width):
    num, num_kv_heads, _ = picks.shape
    return picks.new_empty(num_kv_heads, num * width, dtype=table.dtype), picks.new_empty(num, dtype=torch.int64)
