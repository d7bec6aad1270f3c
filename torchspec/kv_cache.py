"""The paged KV pool (page size 1: one slot = one token's K/V row in every layer) and its slot allocator."""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from torchspec.transfer import to_device

# Share of the device memory left after the weights and the step workspace that an automatic pool takes by default
# (``kv_memory_fraction``); the rest absorbs what the estimate misses (allocator fragmentation, compiled kernels).
DEFAULT_DEVICE_MEMORY_FRACTION = 0.9
# Copies of a step's draft lists alive at once while they are built (positions, their slots, masked copies).
_DRAFT_LIST_COPIES = 4
# A key sketch's scale (fp32) beside its codes (``KVPool.scales``).
SKETCH_SCALE_BYTES = 4
# Share of the host's available memory a CPU pool may take when sized automatically.
_HOST_MEMORY_FRACTION = 0.25
# What PyTorch's CUDA caching allocator rounds a large allocation's segment up to (its kRoundLarge).
ALLOCATOR_SEGMENT_BYTES = 2 << 20


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer asks of the KV pool and the attention op (read from the model itself)."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None


class SlotAllocator:
    """Free stack of physical KV slots. Lowest slots are handed out first, so small runs stay compact.

    A NumPy stack, not a Python list: an automatic pool on a large GPU holds millions of slots (5M for SmolLM2
    on an H200), which a list of ints would hold at ~36 bytes each and build in a second."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.int64)  # free slots, next one on top
        self._top = num_slots

    @property
    def num_free(self) -> int:
        return self._top

    def free_slots(self) -> np.ndarray:
        """A copy of the free slots (for checks: every slot free exactly once at the end of a run)."""
        return self._stack[: self._top].copy()

    def allocate(self, count: int) -> list[int]:
        if count > self._top:
            raise RuntimeError(f"KV pool exhausted: {count} slots requested, {self._top} free")
        self._top -= count
        return self._stack[self._top : self._top + count][::-1].tolist()

    def free(self, slots: Sequence[int]) -> None:
        count = len(slots)
        self._stack[self._top : self._top + count] = slots
        self._top += count


class KVPool:
    """One K and one V tensor per layer, ``[num_slots + 1, num_kv_heads, head_dim]``; layers may differ in shape.
    The extra row, ``scratch_slot``, is never allocated: padding tokens of a captured step write there.

    The layers ``sketched`` (indices) also keep their keys' int4 sketch, written as keys are stored, for a draft
    that scores every cached key (``attention.reference.store_key_sketch``): ``codes[layer]`` ``[num_slots + 1,
    Hkv, head_dim // 2]`` uint8 and ``scales[layer]`` ``[num_slots + 1, Hkv]`` fp32 (None for the other layers)."""

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        sketched: Collection[int] = (),
    ) -> None:
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        rows = num_slots + 1
        self.k = [_pool_tensor((rows, s.num_kv_heads, s.head_dim), dtype, device) for s in layers]
        self.v = [_pool_tensor((rows, s.num_kv_heads, s.head_dim), dtype, device) for s in layers]
        self.codes = [
            _pool_tensor((rows, s.num_kv_heads, s.head_dim // 2), torch.uint8, device)
            if s.layer_idx in sketched
            else None
            for s in layers
        ]
        self.scales = [
            _pool_tensor((rows, s.num_kv_heads), torch.float32, device) if s.layer_idx in sketched else None
            for s in layers
        ]
        self.allocator = SlotAllocator(num_slots)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a row per slot (K, V, key sketches): what moves or is copied with a token's K/V."""
        return self.k + self.v + [t for t in self.codes + self.scales if t is not None]

    def copy(self, sources: Sequence[int], destinations: Sequence[int]) -> None:
        """Copy the rows of slots ``sources`` into slots ``destinations`` in every layer, queued on the device
        (one prompt's K/V for each of its other samples, ``num_return_sequences``)."""
        index = to_device([sources, destinations], self.k[0].device)
        for rows in self.slot_tensors():
            rows[index[1]] = rows[index[0]]


def _pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)`` that fills whole allocator segments on a GPU. PyTorch's caching allocator gives a
    tensor over 10 MiB a segment rounded up to ``ALLOCATOR_SEGMENT_BYTES`` and lends the rest to later allocations; a
    long-lived one there (the projections ``wrap()`` fuses, made after the pool and kept by the model) would keep
    the segment, pool and all, from going back to the driver once the engine is dropped: the next engine in the
    process found 33 of an H100's 78 GB held so, and sized its pool at half the first one's."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    padded = -(-numel * dtype.itemsize // ALLOCATOR_SEGMENT_BYTES) * ALLOCATOR_SEGMENT_BYTES
    return torch.empty(padded, dtype=torch.uint8, device=device).view(dtype)[:numel].view(shape)


def bytes_per_token(layers: Sequence[LayerSpec], dtype: torch.dtype, sketched: Collection[int] = ()) -> int:
    """Pool bytes one token occupies across all layers: its K/V, and its key sketch in the layers ``sketched``."""
    element = torch.empty((), dtype=dtype).element_size()
    sketch = sum(s.num_kv_heads * (s.head_dim // 2 + SKETCH_SCALE_BYTES) for s in layers if s.layer_idx in sketched)
    return sum(2 * s.num_kv_heads * s.head_dim * element for s in layers) + sketch


def auto_capacity_tokens(
    layers: Sequence[LayerSpec],
    dtype: torch.dtype,
    device: torch.device,
    workspace_bytes: int,
    host_ceiling_tokens: int,
    step_bytes_per_token: float = 0.0,
    device_fraction: float = DEFAULT_DEVICE_MEMORY_FRACTION,
    sketched: Collection[int] = (),
) -> int:
    """Size the pool from free memory, after the weights (already loaded) and ``workspace_bytes`` (what steps
    allocate besides the pool: logits, sampling, graphs; see ``step_workspace_bytes``).

    On a GPU the pool takes ``device_fraction`` of what is left (after the allocator's cache is emptied), with
    no cap from the model's context length: requests longer than the batch's share of the pool only wait when
    memory itself runs out. Each token also costs ``step_bytes_per_token`` of step buffers that grow with the
    context the batch holds (slot lists, verify mass; see ``step_list_bytes``), and in the layers ``sketched`` its
    key's sketch (``KVPool``). On a CPU it takes at most a quarter of the host's available RAM and no more than
    ``host_ceiling_tokens`` (max batch x context), since the host's memory is everybody's.
    """
    per_token = bytes_per_token(layers, dtype, sketched)
    if device.type == "cuda":
        free, _ = reclaim_device_memory(device)
        tokens = int((free - workspace_bytes) * device_fraction / (per_token + step_bytes_per_token))
    else:
        budget = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * _HOST_MEMORY_FRACTION)
        tokens = min(budget // per_token, host_ceiling_tokens)
    if tokens < 1:
        raise MemoryError(
            f"no memory left for a KV pool on {device} ({per_token} bytes per token, {workspace_bytes} bytes of step "
            "workspace); free memory, lower max_batch_size or pass kv_capacity_tokens explicitly"
        )
    return tokens


def reclaim_device_memory(device: torch.device) -> tuple[int, int]:
    """Hand an earlier engine's pool, dropped but kept in PyTorch's allocator cache, back to the driver (after a
    gc), then return the driver's (free, total) bytes. What the cache still holds is not counted free: blocks that
    smaller tensors have split since cannot hold a pool's large tensors (counting them ran W1's sweep out of
    memory at its third engine)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def step_list_bytes(
    sparse_kv_heads: int,
    chain_forwards: int,
    sparsity: float,
    min_entries: int,
    step_entries: int,
    context_bound: int,
    scored: bool,
) -> tuple[int, int, float]:
    """Device memory of a step's slot lists and verify mass, which grow with the batch and its contexts, as
    ``(bytes per step, bytes per request, bytes per token of context)``: each context token's slot in the full
    lists (int64, about three copies as a step builds them); the draft lists of ``chain_forwards`` forwards over
    ``sparse_kv_heads`` (layer, KV head) pairs (``_DRAFT_LIST_COPIES`` copies while built), each list up to twice
    its ``sparsity`` share of the context (a policy's recent run grows to a budget before it learns again), at
    least ``min_entries`` long, and all of a forward's at least ``step_entries`` together; and, when PillarAttn
    scores the verify, its mass (bf16 per pair), a row per request as wide as the longest context
    (``context_bound``). W3 ran out of memory without them (1,024 requests' chain lists took 1 GB per copy beside a
    pool sized from free memory), and again with offload, which fills the pool, when the lists were counted at
    their budget and the mass by the tokens held."""
    per_draft_entry = _DRAFT_LIST_COPIES * 8 * sparse_kv_heads * chain_forwards
    per_token = 3 * 8 + per_draft_entry * 2 * sparsity
    mass = 2 * sparse_kv_heads * context_bound if scored else 0
    return per_draft_entry * step_entries, per_draft_entry * min_entries + mass, per_token


def step_workspace_bytes(max_step_tokens: int, max_batch_size: int, k: int, vocab_size: int) -> int:
    """Device memory a step may take besides the pool: fp32 logits of every query token and the sampling
    tensors made from them (probabilities, warped copies, sorts: ~6 of that size), the step graphs' shared
    logits (one more), the drafts' stored distributions (``[batch, k, V]``), and 2 GiB for activations, graph
    pools and compiled kernels."""
    logits = max_step_tokens * vocab_size * 4
    return 7 * logits + max_batch_size * k * vocab_size * 4 + (2 << 30)
