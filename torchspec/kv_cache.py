"""The paged KV pool (page size 1: one slot = one token's K/V row in every layer) and its slot allocator."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Memory left to activations, logits and the allocator when the pool is sized from free device memory.
_DEVICE_MEMORY_FRACTION = 0.85
_DEVICE_RESERVE_BYTES = 2 << 30
# Share of the host's available memory a CPU pool may take when sized automatically.
_HOST_MEMORY_FRACTION = 0.25


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
    """Free list of physical KV slots. Lowest slots are handed out first, so small runs stay compact."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"KV pool exhausted: {count} slots requested, {len(self._free)} free")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        taken.reverse()
        return taken

    def free(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)


class KVPool:
    """One K and one V tensor per layer, ``[num_slots + 1, num_kv_heads, head_dim]``; layers may differ in shape.
    The extra row, ``scratch_slot``, is never allocated: padding tokens of a captured step write there."""

    def __init__(self, layers: Sequence[LayerSpec], num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.k = [torch.empty(num_slots + 1, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for s in layers]
        self.v = [torch.empty_like(k) for k in self.k]
        self.allocator = SlotAllocator(num_slots)


def bytes_per_token(layers: Sequence[LayerSpec], dtype: torch.dtype) -> int:
    """KV bytes one token occupies across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(2 * s.num_kv_heads * s.head_dim * element for s in layers)


def auto_capacity_tokens(
    layers: Sequence[LayerSpec], dtype: torch.dtype, device: torch.device, ceiling_tokens: int
) -> int:
    """Size the pool from free memory: most of what a GPU has left, a quarter of the host's RAM on CPU.

    ``ceiling_tokens`` (max batch x context) caps it, so a CPU run does not claim memory it cannot use.
    """
    per_token = bytes_per_token(layers, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _DEVICE_MEMORY_FRACTION) - _DEVICE_RESERVE_BYTES
    else:
        budget = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * _HOST_MEMORY_FRACTION)
    tokens = min(budget // per_token, ceiling_tokens)
    if tokens < 1:
        raise MemoryError(
            f"no memory left for a KV pool on {device} ({per_token} bytes per token); free memory or pass "
            "kv_capacity_tokens explicitly"
        )
    return tokens
