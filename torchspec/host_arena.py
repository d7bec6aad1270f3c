"""Host memory for offloaded K/V: page-locked once, in growing slabs, and lent out in fixed-size blocks again and again.

Page-locking is what made offloads slow: ``torch.empty(pin_memory=True)`` asks the driver (``cudaHostAlloc``) to fault
in and lock every page on one thread, ~1 GB/s, and W3's offload run (H100, 55.8 GB moved out, each request once, so
no pinned buffer was ever reused) spent 52 s of host time issuing its copies, 21% of the run. Here a slab's pages are
first touched by torch's multithreaded fill (every core faults pages in), then registered with the driver
(``cudaHostRegister``, which then only locks resident pages), which is how TensorRT-LLM and cuDF bring their pinned
pools up fast. Slabs double, so a run grows the arena a few times; a slab stays pinned until the arena goes, its
blocks cycle between requests. On a CPU the blocks are plain memory: the same path, no driver.
"""

from __future__ import annotations

import time
import weakref

import torch

# A request's bytes travel as one copy per block (4 MiB copies run at the link's full speed; 48 of them move an
# 8K-token SmolLM2 request), and a request wastes less than a block.
BLOCK_BYTES = 4 << 20
# The first slab (small: a run that barely offloads, and every CPU test with offload, makes one); each later one
# doubles the arena, so W3's 56 GB took ~10 growths.
FIRST_SLAB_BYTES = 64 << 20


class HostMemoryError(RuntimeError):
    """The host could not give (or page-lock) the memory the arena grows by: ``str()`` says how much."""


class HostArena:
    """Blocks of ``block_bytes`` of host memory (page-locked with ``pin``), lent whole and given back whole. Growth
    stops at ``limit_bytes`` unless a single request needs more than is left (the scheduler bounds what the host
    tier holds; this only keeps doubling from overshooting it)."""

    def __init__(
        self,
        pin: bool,
        limit_bytes: int,
        block_bytes: int = BLOCK_BYTES,
        first_slab_bytes: int = FIRST_SLAB_BYTES,
    ) -> None:
        self.pin = pin
        self.limit_bytes = limit_bytes
        self.block_bytes = block_bytes
        self.first_slab_bytes = first_slab_bytes
        self._slabs: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []  # blocks not lent out
        self.reserve_s = 0.0  # host time spent making (and on CUDA page-locking) slabs
        if pin:  # unregistered before the slabs are freed, whenever the arena goes
            weakref.finalize(self, _unregister, self._slabs)

    @property
    def reserved_bytes(self) -> int:
        return sum(slab.numel() for slab in self._slabs)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.block_bytes)

    def ensure(self, count: int) -> None:
        """Have ``count`` blocks free, growing the arena if short; raises ``HostMemoryError`` if the host has no
        memory for it (the arena as it was)."""
        if count > len(self._free):
            self._grow(count - len(self._free))

    def take(self, nbytes: int) -> list[torch.Tensor]:
        """As many blocks as ``nbytes`` fill (the last one partly), growing the arena if short."""
        count = self.blocks_for(nbytes)
        self.ensure(count)
        blocks, self._free = self._free[len(self._free) - count :], self._free[: len(self._free) - count]
        return blocks

    def give(self, blocks: list[torch.Tensor]) -> None:
        """Take lent blocks back. On CUDA their last copy must be queued on the stream every later copy into or out
        of the arena queues on (the host tier's side stream), so the next borrower's copy runs after it."""
        self._free.extend(blocks)

    def _grow(self, blocks: int) -> None:
        reserved = self.reserved_bytes
        doubling = max(reserved, self.first_slab_bytes)
        size = max(blocks * self.block_bytes, min(doubling, self.limit_bytes - reserved))
        size = -(-size // self.block_bytes) * self.block_bytes
        start = time.perf_counter()
        try:
            slab = torch.empty(size, dtype=torch.uint8)
        except RuntimeError as error:  # the CPU allocator's "can't allocate memory"
            raise HostMemoryError(f"allocating {size} bytes ({error})") from error
        slab.zero_()  # every core faults pages in (torch's fill is parallel); the driver's pinning alone is 1 GB/s
        if self.pin:
            status = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), size, 0))
            if status != 0:
                raise HostMemoryError(f"page-locking {size} bytes (CUDA error {status})")
        self._slabs.append(slab)
        self._free.extend(slab.split(self.block_bytes))
        self.reserve_s += time.perf_counter() - start


def _unregister(slabs: list[torch.Tensor]) -> None:
    for slab in slabs:
        torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
    slabs.clear()
