"""Per-request columns on the device that CUDA graphs read at fixed addresses: a draft chain's sampling
(``DraftSampling``) and a plain batch's (``PlainBatch``). A graph captures a bucket's buffers; each batch's columns are
written into their first rows before it replays, the rows past them keeping valid values."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar, Self

import torch


class RowColumns:
    """Mixin for a dataclass of per-request device tensors (request i in row i) beside host values; ``SHARED``
    names its tensors that are not one entry per request, which copies keep as they are."""

    SHARED: ClassVar[tuple[str, ...]] = ()

    def buffers(self, size: int) -> Self:
        """Columns of the same layout for ``size`` rows, each row a copy of this one's first: fixed-address
        buffers that batches are written into (``write_rows``); a row no request fills holds valid values."""
        return self._each_column(lambda column: column[:1].expand(size, *column.shape[1:]).clone())

    def write_rows(self, fixed: Self) -> int:
        """Write these columns into the first rows of ``fixed`` (``buffers`` of the same layout); returns how many
        rows that is."""
        count = 0
        for name, column in self._columns().items():
            getattr(fixed, name)[: column.shape[0]] = column
            count = column.shape[0]
        return count

    def _columns(self) -> dict[str, torch.Tensor]:
        """The per-request tensors by field name (host values, absent ones and ``SHARED`` left out)."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {
            name: value for name, value in values.items() if isinstance(value, torch.Tensor) and name not in self.SHARED
        }

    def _each_column(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """These columns with ``change`` applied to every per-request tensor, the rest kept."""
        return dataclasses.replace(self, **{name: change(column) for name, column in self._columns().items()})
