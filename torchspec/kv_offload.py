"""The host tier of the KV cache: whole requests' K/V moved out of the device pool and back, never recomputed.

With ``offload=True`` the scheduler admits requests by the slots they hold, not their worst case, and when
the next step would not fit it moves whole requests (the most recently admitted first) out of the pool; as
space frees they come back before new requests are admitted (torchspec/scheduler.py decides which and when).
This module only moves the bytes: a request's computed positions, gathered from its device slots, and scattered
back into the new slots it gets on return. A draft policy's state is kept as positions, not slots, so it
survives the move. On a CPU the host tier is a second buffer behind the same code path, which is what CI tests.

A request's rows of every pool tensor travel as one byte buffer (each tensor's rows a 16-byte aligned chunk of
it), held on the host in blocks of the host arena (torchspec/host_arena.py: page-locked once and reused, where a
pinned allocation per move cost W3 52 s of host time). On CUDA the host<->device copies run on a side stream, so
they overlap the forwards instead of queueing between them: an offload gathers its rows into the buffer on the
compute stream (a device-to-device copy at HBM speed; the slots given up are rewritten only by steps queued after
it) and the side stream carries it to the host blocks; a restore brings it back on the side stream, issued while
the host runs ahead of the GPU, and the compute stream waits for that copy only where it scatters the rows into
their new slots. Every copy into or out of the arena queues on the one side stream, so a restore never reads
blocks before its offload filled them, and blocks given back are refilled only after their restore read them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from torchspec.host_arena import BLOCK_BYTES, HostArena, HostMemoryError
from torchspec.kv_cache import KVPool
from torchspec.transfer import to_device

# Share of the host's available memory an automatic host tier may take.
_HOST_TIER_MEMORY_FRACTION = 0.5
# Each pool tensor's chunk of a request's byte buffer starts at a multiple of this (any dtype's view is aligned).
_CHUNK_ALIGN = 16
# Device memory a step's restores stage their K/V in, at most (each comes in whole before it is scattered into its
# slots, and stays until the step that reads it has run): a wave of finishing requests freed room for dozens at
# once, whose staging (~190 MB each at 8K tokens of SmolLM2) came on top of a full pool.
RESTORE_STAGING_BYTES = 1 << 30


def restore_step_tokens(bytes_per_token: int) -> int:
    """K/V rows a step may bring back (``RESTORE_STAGING_BYTES`` of them); one request always may."""
    return max(1, RESTORE_STAGING_BYTES // bytes_per_token)


def auto_host_capacity_tokens(bytes_per_token: int) -> int:
    """Tokens the host tier may hold when ``host_kv_capacity_tokens`` is None: half of the available RAM."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * _HOST_TIER_MEMORY_FRACTION) // bytes_per_token


@dataclass
class OffloadStats:
    """What the host tier did in one run (reported in ``last_stats`` and the benchmark records)."""

    offloaded_tokens: int = 0  # K/V rows moved to the host
    offloaded_bytes: int = 0  # their size, every layer's K and V (and key sketches)
    restored_tokens: int = 0  # K/V rows moved back
    recomputed_tokens: int = 0  # K/V rows computed a second time: always 0, the host tier never drops any
    peak_device_tokens: int = 0  # most pool slots held at once
    peak_host_tokens: int = 0  # most K/V rows on the host at once
    transfer_s: float = 0.0  # host time spent issuing (on a CPU: doing) the copies
    # Host time making host memory (page-locked on CUDA) for the arena: mostly when the scheduler asks whether the
    # host takes a request (``refusal``), outside ``transfer_s``; at a move otherwise, inside it.
    reserve_s: float = 0.0
    host_reserved_bytes: int = 0  # the arena's size at the end of the run (it stays for later runs)
    copy_s: float = 0.0  # device time of the side stream's copies (CUDA; on a CPU the copies are transfer_s)


class HostKVStore:
    """Offloaded requests' rows of every pool tensor (``KVPool.slot_tensors``: K/V per layer, key sketches), one
    byte buffer per request (see ``_chunks``) in blocks of the host arena, keyed by request id. ``capacity_tokens``:
    the most rows the host tier holds (the scheduler keeps to it; the arena grows no further than it needs);
    ``block_bytes``: the arena's block, the most one copy moves."""

    def __init__(self, pool: KVPool, capacity_tokens: int, block_bytes: int = BLOCK_BYTES) -> None:
        self.pool = pool
        self.device = pool.k[0].device
        self._held: dict[int, list[torch.Tensor]] = {}
        self.stats = OffloadStats()
        self._token_bytes = sum(map(_row_bytes, pool.slot_tensors()))
        self._arena = HostArena(self.device.type == "cuda", capacity_tokens * self._token_bytes, block_bytes)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # copies not yet counted in copy_s

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def offload(self, request_id: int, slots: Sequence[int]) -> None:
        """Copy the K/V at ``slots`` (a request's computed positions, in order) to the host; raises
        ``HostMemoryError`` (nothing copied, nothing held) when the host has no memory for it."""
        start, reserving = time.perf_counter(), self._arena.reserve_s
        size = self._buffer_bytes(len(slots))
        blocks = self._arena.take(size)  # first: a HostMemoryError leaves nothing queued
        index = to_device(slots, self.device)
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        for rows, chunk in zip(self.pool.slot_tensors(), self._chunks(buffer, len(slots)), strict=True):
            torch.index_select(rows, 0, index, out=chunk)
        with self._side_stream(to_host=True):
            if self._stream is not None:
                buffer.record_stream(self._stream)  # gathered on the compute stream, read on the side stream
            for piece, block in self._pieces(buffer, blocks):
                block.copy_(piece, non_blocking=True)
        self._held[request_id] = blocks
        self.stats.offloaded_tokens += len(slots)
        self.stats.offloaded_bytes += len(slots) * self._token_bytes
        self.stats.reserve_s += self._arena.reserve_s - reserving
        self.stats.transfer_s += time.perf_counter() - start

    def refusal(self, rows: Sequence[int]) -> str | None:
        """Why the host cannot take requests of ``rows`` K/V rows each (a plan's offloads so far and the next),
        or None when it can: the arena grows now, while the scheduler can still choose, if it must."""
        # A bound on each request's buffer (every chunk's alignment at most _CHUNK_ALIGN), cheap to sum: a wave of
        # offloads asks once per request about all of the step's so far.
        padding = _CHUNK_ALIGN * len(self.pool.slot_tensors())
        reserving = self._arena.reserve_s
        try:
            self._arena.ensure(sum(self._arena.blocks_for(count * self._token_bytes + padding) for count in rows))
        except HostMemoryError as error:
            return f"the host had no memory for them: {error}"
        finally:
            self.stats.reserve_s += self._arena.reserve_s - reserving
        return None

    def restore(self, request_id: int, slots: Sequence[int]) -> None:
        """Copy a request's K/V back into ``slots`` (as many as it offloaded, in position order) and forget it."""
        start = time.perf_counter()
        blocks = self._held.pop(request_id)
        index = to_device(slots, self.device)
        with self._side_stream(to_host=False):
            buffer = torch.empty(self._buffer_bytes(len(slots)), dtype=torch.uint8, device=self.device)
            for piece, block in self._pieces(buffer, blocks):
                piece.copy_(block, non_blocking=True)
        self._arena.give(blocks)
        for rows, chunk in zip(self.pool.slot_tensors(), self._chunks(buffer, len(slots)), strict=True):
            rows.index_copy_(0, index, chunk)
        if self._stream is not None:  # made on the side stream, read on the compute stream
            buffer.record_stream(torch.cuda.current_stream(self.device))
        self.stats.restored_tokens += len(slots)
        self.stats.transfer_s += time.perf_counter() - start

    def _pieces(self, buffer: torch.Tensor, blocks: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The buffer's block-sized pieces, each with as much of its host block (none for a request with nothing
        computed yet: a sample waiting for its prompt's K/V)."""
        size = self._arena.block_bytes
        for i, block in enumerate(blocks):
            piece = buffer[i * size : (i + 1) * size]
            yield piece, block[: piece.numel()]

    def _buffer_bytes(self, count: int) -> int:
        return sum(_aligned(count * _row_bytes(rows)) for rows in self.pool.slot_tensors())

    def _chunks(self, buffer: torch.Tensor, count: int) -> list[torch.Tensor]:
        """Each pool tensor's ``count`` rows as a view of ``buffer``: its chunk of bytes, in ``slot_tensors`` order."""
        chunks, offset = [], 0
        for rows in self.pool.slot_tensors():
            size = count * _row_bytes(rows)
            chunks.append(buffer[offset : offset + size].view(rows.dtype).view(count, *rows.shape[1:]))
            offset += _aligned(size)
        return chunks

    def settle(self) -> OffloadStats:
        """Wait for the copies in flight and add their device time to ``copy_s`` (at the end of a run)."""
        if self._stream is not None:
            self._stream.synchronize()
            self.stats.copy_s += sum(begin.elapsed_time(end) for begin, end in self._timings) / 1e3
            self._timings.clear()
        self.stats.host_reserved_bytes = self._arena.reserved_bytes
        return self.stats

    def drop(self, request_id: int) -> None:
        """Forget a request that will not come back (the run stopped)."""
        self._arena.give(self._held.pop(request_id, []))

    @contextlib.contextmanager
    def _side_stream(self, to_host: bool) -> Iterator[None]:
        """Run the enclosed copies on the side stream. To the host: after the work queued so far on the compute
        stream (which gathers the rows), and no forward waits for them (they read rows of their own). To the
        device: at once (the host buffers were filled earlier on this same stream), and the compute stream's
        later work (the scatter into the new slots) waits for them."""
        if self._stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        if to_host:
            self._stream.wait_stream(compute)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record()
            yield
            end.record()
        if not to_host:
            compute.wait_stream(self._stream)
        self._timings.append((begin, end))


def _row_bytes(rows: torch.Tensor) -> int:
    """Bytes of one slot's row of a pool tensor."""
    return rows[0].numel() * rows.element_size()


def _aligned(size: int) -> int:
    return -(-size // _CHUNK_ALIGN) * _CHUNK_ALIGN
