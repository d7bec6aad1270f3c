"""The bridge to transformers: route a model's attention to our paged ops and read what each layer needs.

The model runs unmodified as a packed ``[1, T]`` batch with per-request ``position_ids`` and
``use_cache=False``; every attention layer calls :func:`paged_attention_forward` (registered with
transformers' ``AttentionInterface``), which reads the step's metadata from the active forward context.
Because the registered name has no mask function, transformers builds no attention mask for it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from attention.reference import MASS_DTYPE, FirstLists, rotary_embedding
from torchspec.kv_cache import KVPool, LayerSpec
from torchspec.step import AttentionMetadata

ATTENTION_NAME = "torchspec"

# Keyword arguments transformers passes to attention functions that need no handling here.
_IGNORED_ATTENTION_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions"})


def verify_mass_shape(layer_heads: dict[int, int], verifies: int, width: int) -> tuple[int, int, int, int]:
    """``[layers, KV heads, verifies, width]`` of a verify mass buffer. Rows are padded to 16 bytes, so every
    layer's slab starts 16-byte aligned: Triton specialises a kernel on its pointers' alignment, and slabs
    aligned on alternate layers would compile the mass kernel twice."""
    per_16_bytes = 16 // MASS_DTYPE.itemsize
    return len(layer_heads), max(layer_heads.values(), default=0), verifies, -(-width // per_16_bytes) * per_16_bytes


def verify_mass_buffer(
    layer_heads: dict[int, int],
    verifies: int,
    width: int,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[int, int]]:
    """A zeroed buffer for a step's verify mass (``AttentionMetadata.mass``) over the full-attention layers
    ``layer_heads`` (layer -> KV heads, in the draft policy's order), and each layer's index in it. ``out``: a
    zeroed tensor of ``verify_mass_shape`` to use instead (graphs share one storage)."""
    mass = (
        out
        if out is not None
        else torch.zeros(verify_mass_shape(layer_heads, verifies, width), dtype=MASS_DTYPE, device=device)
    )
    return mass, {layer: index for index, layer in enumerate(layer_heads)}


class AttentionContext(Protocol):
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        sliding_window: int | None,
        extra_kwargs: dict[str, Any],
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``[T, H, D]``; with ``rotary`` (``cos``, ``sin``: ``[T, D]``) query and key are not yet rotated."""
        ...


@dataclass
class PagedForwardContext:
    """A step of the engine: store new K/V in the pool, attend over each request's slot list."""

    metadata: AttentionMetadata
    pool: KVPool
    ops: ModuleType
    # What the forward's layers share, computed at the first that needs it (a forward run of a graph's capture
    # makes its own: a new context each run).
    shared: dict[str, Any] = field(default_factory=dict)

    def attend(self, module, query, key, value, attention_mask, scaling, sliding_window, extra_kwargs, rotary=None):
        # One opaque op per layer: a compiled forward never traces (or guards on) this step's metadata.
        cos, sin = rotary if rotary is not None else (None, None)
        return torch.ops.torchspec.attend(query, key, value, cos, sin, module.layer_idx, scaling, sliding_window)

    def attend_layer(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the layer's new K/V (``[1, Hkv, T, D]``) and attend with ``query`` (``[1, H, T, D]``); returns
        ``[T, H, D]``. Given ``cos``/``sin``, query and key are rotated first (with the store: one kernel)."""
        meta, ops = self.metadata, self.ops
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))
        if cos is None:
            ops.store_kv(k_cache, v_cache, key, value, meta.slot_mapping)
        else:
            query = ops.rotary_store_kv(query, key, value, cos, sin, k_cache, v_cache, meta.slot_mapping)
        if self.pool.codes[layer] is not None:  # the new keys' sketch, for a draft that scores every cached key
            ops.store_key_sketch(k_cache, meta.slot_mapping, self.pool.codes[layer], self.pool.scales[layer])
        if sliding_window is not None:
            view = meta.windowed[sliding_window]
            return ops.paged_attention(
                query,
                k_cache,
                v_cache,
                meta.cu_seqlens_q,
                view.kv_indptr,
                view.kv_indices,
                scaling,
                sliding_window,
                max_q_len=meta.max_q_len,
                max_kv_len=view.max_len,
                kv_ends=view.kv_ends,
            )[0]
        drafts, first_lists = meta.num_drafts, None
        if drafts:
            # Draft requests (one token each) read their sparse lists in the same launch as the others.
            if meta.draft_choice is not None:
                view = meta.draft_choice.lists(layer, query[:drafts], scaling, self.shared)
            elif meta.draft_select is not None:
                view = meta.draft_select(layer, query[:drafts], k_cache, scaling)
            else:
                view = meta.draft[layer]
            first_lists = FirstLists(drafts, view.kv_indptr, view.kv_indices, 1, view.max_len, view.kv_ends)
        scored = meta.num_scored_queries is not None
        return ops.paged_attention(
            query,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.full.kv_indptr,
            meta.full.kv_indices,
            scaling,
            max_q_len=meta.max_q_len,
            max_kv_len=meta.full.max_len,
            first_lists=first_lists,
            mass=meta.mass[meta.mass_layers[layer], : k_cache.shape[1]] if scored else None,
            num_scored_queries=meta.num_scored_queries,
            max_scored_queries=meta.max_scored_queries,
            kv_ends=meta.full.kv_ends,
            live_requests=meta.live_requests,
        )[0]


_active_context: AttentionContext | None = None


@contextlib.contextmanager
def forward_context(context: AttentionContext) -> Iterator[None]:
    """Make ``context`` the one the registered attention function uses for the forwards inside."""
    global _active_context
    previous, _active_context = _active_context, context
    try:
        yield
    finally:
        _active_context = previous


@torch.library.custom_op("torchspec::attend", mutates_args=())
def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    layer: int,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """A layer's attention in an engine step (it also writes the layer's K/V into the pool, which is not an
    argument: the op must never be reordered across layers' ops that read it, and is not, since each layer
    reads only its own pool tensor after writing it in the same op)."""
    if not isinstance(_active_context, PagedForwardContext):
        raise RuntimeError("torchspec::attend runs only inside an engine step")
    return _active_context.attend_layer(layer, query, key, value, scaling, sliding_window, cos, sin)


@_attend.register_fake
def _(query, key, value, cos, sin, layer, scaling, sliding_window):
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` is ``[1, H, T, D]``, K/V ``[1, Hkv, T, D]`` (RoPE applied, unless
    torchspec's fused layers pass ``rotary``: ``cos``, ``sin`` ``[T, D]`` to apply with the K/V store)."""
    if _active_context is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} only runs inside a torchspec engine step; "
            "call generate() on the SparseSpecForCausalLM wrapper"
        )
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    out = _active_context.attend(module, query, key, value, attention_mask, scaling, sliding_window, kwargs, rotary)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextlib.contextmanager
def routed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Point ``model``'s attention at torchspec for the duration, then restore the user's choice."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def model_dtype_forwards(model: torch.nn.Module) -> dict[torch.nn.Module, Callable]:
    """Forwards for ``model``'s children (its base model and head) that run them without autocast: installed for an
    engine run (``replaced_forwards``), the engine computes in the model's own dtype (its K/V pool's and its
    kernels') whatever autocast a client has entered, around the call or inside the model's forward, where
    accelerate's mixed precision puts one (TRL's trainer does, bf16 on a CPU, and leaves it on the model after
    training); under one, transformers' layers would hand bf16 activations to an fp32 pool. The children are
    wrapped, not the model, whose own ``forward`` may hold the autocast. Made once per engine, so that a compiled
    model meets the same functions every run."""
    device_type = next(model.parameters()).device.type
    return {module: _without_autocast(module.forward, device_type) for _, module in model.named_children()}


@contextlib.contextmanager
def replaced_forwards(forwards: dict[torch.nn.Module, Callable]) -> Iterator[None]:
    """Each module runs the forward given for it for the duration, then its own again (an instance attribute a
    client set, such as an accelerate hook, is put back)."""
    own = {module: module.__dict__.get("forward") for module in forwards}
    for module, forward in forwards.items():
        module.forward = forward
    try:
        yield
    finally:
        for module, forward in own.items():
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _without_autocast(forward: Callable, device_type: str) -> Callable:
    @functools.wraps(forward)
    def run(*args: object, **kwargs: object) -> object:
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)

    return run


class UnsupportedModelError(ValueError):
    """The model's attention cannot be routed to torchspec's paged ops."""


class _ProbeContext:
    """Records what every layer asks of attention, computing plain causal attention to keep going."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerSpec] = {}
        self.problems: list[str] = []

    def attend(self, module, query, key, value, attention_mask, scaling, sliding_window, extra_kwargs, rotary=None):
        if rotary is not None:  # a fused layer's unrotated query and key
            query, key = (t[0].transpose(0, 1) for t in (query, key))
            query, key = (t.transpose(0, 1)[None] for t in rotary_embedding(query, key, *rotary))
        name = type(module).__name__
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None:
            self.problems.append(f"{name} has no `layer_idx`, so its KV cache cannot be addressed")
        if attention_mask is not None:
            self.problems.append(f"{name} builds its own attention mask, which paged attention cannot honour")
        if getattr(module, "is_causal", True) is False:
            self.problems.append(f"{name} is bidirectional (is_causal=False); only causal decoders are supported")
        extras = sorted(
            key
            for key, val in extra_kwargs.items()
            if key not in _IGNORED_ATTENTION_KWARGS and val is not None and val is not False
        )
        if extras:
            self.problems.append(f"{name} passes attention options torchspec does not implement: {extras}")
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        if layer_idx is not None:
            self.layers[layer_idx] = LayerSpec(
                layer_idx=layer_idx,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=query.shape[-1],
                scaling=float(scaling),
                sliding_window=sliding_window,
            )
        group = num_heads // num_kv_heads
        out = F.scaled_dot_product_attention(
            query,
            key.repeat_interleave(group, 1),
            value.repeat_interleave(group, 1),
            is_causal=True,
            scale=scaling,
        )
        return out[0].transpose(0, 1)


def probe_attention_layers(model: torch.nn.Module) -> list[LayerSpec]:
    """Run a 3-token forward through the routed attention and return each layer's needs.

    Raises :class:`UnsupportedModelError` naming the model and the reason when its attention cannot be
    routed (encoder-decoder, no AttentionInterface support, layers that never call attention, custom masks,
    attention options such as logit soft-capping or sink tokens).
    """
    config = model.config
    model_name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_name} is an encoder-decoder model; torchspec serves decoder-only LMs")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{model_name} does not route attention through transformers' AttentionInterface, so torchspec "
            "cannot replace its attention; use a model class that supports `attn_implementation`"
        )
    probe = _ProbeContext()
    device = next(model.parameters()).device
    input_ids = torch.tensor([[0, 1, 2]], device=device)
    with torch.inference_mode(), routed_attention(model), forward_context(probe):
        model(input_ids=input_ids, position_ids=torch.arange(3, device=device)[None], use_cache=False)
    num_layers = config.get_text_config().num_hidden_layers
    missing = sorted(set(range(num_layers)) - set(probe.layers))
    if missing:
        probe.problems.append(
            f"layers {missing} never called the attention interface (linear-attention or state-space layers?)"
        )
    if probe.problems:
        raise UnsupportedModelError(
            f"cannot route the attention of {model_name}: " + "; ".join(dict.fromkeys(probe.problems))
        )
    return [probe.layers[i] for i in range(num_layers)]
