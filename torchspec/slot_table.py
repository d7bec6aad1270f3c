"""A device-side copy of every running request's slot list, so a step's slots and slot lists are gathered on
the device.

A request holds the slots of every position its next steps may compute (``Request.slots``: its worst case from
admission on, or with ``offload`` its positions so far and room for two rounds, topped up as it grows), so its
row is written when it gets one and extended when it gets more, and every step reads the slots of its positions
from here: the host builds no slot list per step (the host cost grew with the step's tokens) and never needs
to know a position's slot before the device does.

Each row also holds its request's state as the steps queued on the device leave it: how many of its tokens
have their K/V computed (``computed``) and its newest token (``last_tokens``). Every step advances them on the
device (``Runner._advance``) and reads its positions and its newest tokens from them, so a step never needs a
value the host has not read back yet: the host only adds offsets it knows (a prompt chunk's tokens, a round's
drafts) to counts the device keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from torchspec.request import Request
from torchspec.transfer import to_device


class SlotTable:
    """``[rows, width]`` slots on the device, one row per running request (assigned on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots = torch.zeros(0, 0, dtype=torch.int64, device=device)
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self.computed = torch.zeros(0, dtype=torch.int64, device=device)
        self._holders: dict[int, Request] = {}  # row -> the request holding it (its ``table_row``)
        self._written: dict[int, int] = {}  # row -> how many of its holder's slots the row holds
        self._free_rows: list[int] = []

    def reset(self) -> None:
        """Forget every request (a new run starts)."""
        for request in self._holders.values():
            request.table_row = None
        self._holders.clear()
        self._free_rows = list(range(self.slots.shape[0] - 1, -1, -1))

    def row(self, request: Request) -> int:
        """The request's row; on first use, one is assigned and the request's slots written to it."""
        if request.table_row is not None:
            return request.table_row
        if not self._free_rows:
            self._grow(rows=max(8, 2 * self.slots.shape[0]), width=self.slots.shape[1])
        row = self._free_rows.pop()
        self._write(row, request.slots, 0)
        self.computed[row] = request.num_computed_tokens
        request.table_row = row
        self._holders[row] = request
        return row

    def extend(self, requests: Sequence[Request]) -> None:
        """Write the slots each request got since its row was written (a request without a row gets them all
        when it is given one), in one copy and one scatter for all of them: a batch admitted by use tops up
        hundreds of requests a step."""
        rows, columns, slots = [], [], []
        widest = 0
        for request in requests:
            row = request.table_row
            if row is None or len(request.slots) <= self._written[row]:
                continue
            written, end = self._written[row], len(request.slots)
            rows.append(np.full(end - written, row, dtype=np.int64))
            columns.append(np.arange(written, end, dtype=np.int64))
            slots.append(np.asarray(request.slots[written:], dtype=np.int64))
            self._written[row] = end
            widest = max(widest, end)
        if not rows:
            return
        self._fit(widest)
        row, column, slot = to_device(np.stack([np.concatenate(part) for part in (rows, columns, slots)]), self.device)
        self.slots[row, column] = slot

    def _write(self, row: int, slots: Sequence[int], start: int) -> None:
        end = start + len(slots)
        self._fit(end)
        self.slots[row, start:end] = to_device(slots, self.device)
        self._written[row] = end

    def _fit(self, width: int) -> None:
        """Widen the table to hold ``width`` slots a row, at least doubling it (a few regrowths a generation)."""
        if width > self.slots.shape[1]:
            self._grow(rows=self.slots.shape[0], width=max(width, 2 * self.slots.shape[1], 256))

    def release(self, request: Request) -> None:
        """Give a finished request's row back."""
        row = request.table_row
        if row is not None:
            del self._holders[row]
            request.table_row = None
            self._free_rows.append(row)

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.slots.shape
        grown = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        grown[:old_rows, :old_width] = self.slots
        self.slots = grown
        self.last_tokens = _grown(self.last_tokens, rows)
        self.computed = _grown(self.computed, rows)
        self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows

    def gather(
        self,
        rows: Sequence[int],
        starts: Sequence[int],
        ends: Sequence[int],
        shrink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated slots of positions ``[starts[i], ends[i] - shrink[i])`` of each row: the offsets
        (``[len(rows) + 1]``) and the flat slot list, both on the device, built without reading anything back.
        ``shrink`` (device, >= 0; None: none) shortens the ranges by what only the device knows (a round launched
        ahead starts where the round in flight leaves it); the list then keeps the length the host's ranges
        give, its tail past the offsets unused."""
        count = len(rows)
        lengths = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        total = int(indptr[-1])
        sent = to_device(np.concatenate([rows, starts, lengths, indptr]), self.device)
        row, start, length, indptr_t = sent.split([count, count, count, count + 1])
        if shrink is not None:
            indptr_t = torch.cat([indptr_t[:1], (length - shrink).cumsum(0)])
        if total == 0:
            return indptr_t, torch.zeros(0, dtype=torch.int64, device=self.device)
        flat = torch.arange(total, device=self.device)
        if shrink is None:
            entry = torch.repeat_interleave(torch.arange(count, device=self.device), length, output_size=total)
        else:  # the tail past the last offset belongs to the last row, clamped to its width
            entry = torch.searchsorted(indptr_t[1:], flat, right=True).clamp(max=count - 1)
        positions = (flat - indptr_t[entry] + start[entry]).clamp(max=self.slots.shape[1] - 1)
        return indptr_t, self.slots[row[entry], positions]

    def lookup(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots at ``positions`` (any shape, -1 = padding, kept) of ``rows`` (broadcast against it)."""
        return torch.where(positions >= 0, self.slots[rows, positions.clamp(min=0)], -1)


def _grown(values: torch.Tensor, rows: int) -> torch.Tensor:
    """``values`` (one per row) followed by zeros up to ``rows``."""
    grown = torch.zeros(rows, dtype=values.dtype, device=values.device)
    grown[: values.shape[0]] = values
    return grown
