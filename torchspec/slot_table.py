"""A device-side copy of every running request's slot list, so a step's slots and slot lists are gathered on
the device.

A request holds the slots of every position it may ever compute from its admission on (``Request.slots``,
its worst case, which admission reserves anyway), so its row is written once, when it gets one, and every
step reads the slots of its positions from here: the host builds no slot list per step (the host cost grew
with the step's tokens) and never needs to know a position's slot before the device does.

Each row also holds the newest token its request emitted when that is a single token (``last_tokens``), so a
step can be fed the token of the step before it without the host reading it first (delayed verification).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from torchspec.request import Request
from torchspec.transfer import to_device


class SlotTable:
    """``[rows, width]`` slots on the device, one row per running request (assigned on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots = torch.zeros(0, 0, dtype=torch.int64, device=device)
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self._rows: dict[int, int] = {}  # id(request) -> row
        self._free_rows: list[int] = []

    def reset(self) -> None:
        """Forget every request (a new run starts)."""
        self._rows.clear()
        self._free_rows = list(range(self.slots.shape[0] - 1, -1, -1))

    def row(self, request: Request) -> int:
        """The request's row; on first use, one is assigned and the request's slots written to it."""
        key = id(request)
        if key not in self._rows:
            if not self._free_rows:
                self._grow(rows=max(8, 2 * self.slots.shape[0]), width=self.slots.shape[1])
            row = self._rows[key] = self._free_rows.pop()
            count = len(request.slots)
            if count > self.slots.shape[1]:
                self._grow(rows=self.slots.shape[0], width=max(count, 2 * self.slots.shape[1], 256))
            self.slots[row, :count] = to_device(request.slots, self.device)
        return self._rows[key]

    def release(self, request: Request) -> None:
        """Give a finished request's row back."""
        row = self._rows.pop(id(request), None)
        if row is not None:
            self._free_rows.append(row)

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.slots.shape
        grown = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        grown[:old_rows, :old_width] = self.slots
        self.slots = grown
        last_tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
        last_tokens[:old_rows] = self.last_tokens
        self.last_tokens = last_tokens
        self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows

    def gather(self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """Concatenated slots of positions ``[starts[i], ends[i])`` of each row: an indptr (host) and the
        flat slot list (device), built by one gather without reading anything back."""
        lengths = [end - start for start, end in zip(starts, ends, strict=True)]
        indptr = list(itertools.accumulate(lengths, initial=0))
        total = indptr[-1]
        if total == 0:
            return indptr, torch.zeros(0, dtype=torch.int64, device=self.device)
        meta = to_device([rows, starts, indptr[:-1], lengths], self.device)
        row, start, offset, length = meta
        entry = torch.repeat_interleave(torch.arange(len(rows), device=self.device), length, output_size=total)
        positions = torch.arange(total, device=self.device) - offset[entry] + start[entry]
        return indptr, self.slots[row[entry], positions]

    def lookup(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots at ``positions`` (any shape, -1 = padding, kept) of ``rows`` (broadcast against it)."""
        return torch.where(positions >= 0, self.slots[rows, positions.clamp(min=0)], -1)
