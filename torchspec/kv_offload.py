"""The host tier of the KV cache: whole requests' K/V moved out of the device pool and back, never recomputed.

With ``offload=True`` the scheduler admits requests by the slots they hold, not their worst case, and when
the next step would not fit it moves whole requests (the most recently admitted first) out of the pool; as
space frees they come back before new requests are admitted (torchspec/scheduler.py decides which and when).
This module only moves the bytes: a request's computed positions, gathered from its device slots into host
tensors (pinned on CUDA, so the copies queue on the stream like kernels: the slots given up are rewritten
only by steps queued after the copy), and scattered back into the new slots it gets on return. A draft
policy's state is kept as positions, not slots, so it survives the move. On a CPU the host tier is a second
buffer behind the same code path, which is what CI tests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchspec.kv_cache import KVPool
from torchspec.transfer import to_device

# Share of the host's available memory an automatic host tier may take.
_HOST_TIER_MEMORY_FRACTION = 0.5


def auto_host_capacity_tokens(bytes_per_token: int) -> int:
    """Tokens the host tier may hold when ``host_kv_capacity_tokens`` is None: half of the available RAM."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * _HOST_TIER_MEMORY_FRACTION) // bytes_per_token


@dataclass
class OffloadStats:
    """What the host tier did in one run (reported in ``last_stats`` and the benchmark records)."""

    offloaded_tokens: int = 0  # K/V rows moved to the host
    restored_tokens: int = 0  # K/V rows moved back
    recomputed_tokens: int = 0  # K/V rows computed a second time: always 0, the host tier never drops any
    peak_device_tokens: int = 0  # most pool slots held at once
    peak_host_tokens: int = 0  # most K/V rows on the host at once
    transfer_s: float = 0.0  # host time spent issuing (on a CPU: doing) the copies


class HostKVStore:
    """Offloaded requests' K/V per layer, ``[tokens, Hkv, head_dim]`` host tensors keyed by request id."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.device = pool.k[0].device
        self._held: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.stats = OffloadStats()

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def offload(self, request_id: int, slots: Sequence[int]) -> None:
        """Copy the K/V at ``slots`` (a request's computed positions, in order) to the host."""
        start = time.perf_counter()
        index = to_device(slots, self.device)
        keys = [self._to_host(k[index]) for k in self.pool.k]
        self._held[request_id] = (keys, [self._to_host(v[index]) for v in self.pool.v])
        self.stats.offloaded_tokens += len(slots)
        self.stats.transfer_s += time.perf_counter() - start

    def restore(self, request_id: int, slots: Sequence[int]) -> None:
        """Copy a request's K/V back into ``slots`` (as many as it offloaded, in position order) and forget it."""
        start = time.perf_counter()
        keys, values = self._held.pop(request_id)
        index = to_device(slots, self.device)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.pool.k[layer][index] = k.to(self.device, non_blocking=True)
            self.pool.v[layer][index] = v.to(self.device, non_blocking=True)
        self.stats.restored_tokens += len(slots)
        self.stats.transfer_s += time.perf_counter() - start

    def drop(self, request_id: int) -> None:
        """Forget a request that will not come back (the run stopped)."""
        self._held.pop(request_id, None)

    def _to_host(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return rows  # indexing already copied them
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        return host.copy_(rows, non_blocking=True)
