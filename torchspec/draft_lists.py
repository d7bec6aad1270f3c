"""Draft lists: the KV slots sparse draft forwards read, built on the device for a whole round at once.

A request's drafts of one round (forwards 0 .. chain - 1 of its chain) share one list: the positions its policy
fixes for the round (PillarAttn's picks from the last verify, -1 = padding), then the recent run from the
policy's recent start up to the chain's last draft. Forward j reads the prefix that ends at its own position
(a list ends with the query's own token: the causal rule of ``attention.reference``), up to ``ends[j]``. One
list per request and round, where one per draft repeated the fixed part: at W1's full batch (256 requests,
k = 8, 30 layers x 3 KV heads) that built, looked up and copied ~42M entries a round, ~4 ms of GPU time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from torchspec.request import Request
from torchspec.slot_table import SlotTable
from torchspec.step import KVView
from torchspec.transfer import to_device


@dataclass
class RoundLists:
    """The draft lists of a step's ``D`` draft requests for every forward of their chains."""

    view: KVView  # lists [sparse layers, Hkv, N] (or [Hkv, N]), one per request; max_len: the longest
    ends: torch.Tensor  # [longest chain, D]: forward j's end of each list (its start past the request's chain)

    def forward(self, j: int, count: int) -> KVView:
        """What forward ``j`` of the first ``count`` requests reads."""
        view = self.view
        return KVView(view.kv_indptr[: count + 1], view.kv_indices, view.max_len, self.ends[j, :count])


def build_lists(
    table: SlotTable,
    shape: tuple[int, ...],
    rows: np.ndarray,
    last_positions: np.ndarray,
    fixed: Sequence[torch.Tensor] | torch.Tensor,
    recent_from: np.ndarray | None,
    fixed_limit: torch.Tensor | None = None,
) -> tuple[KVView, np.ndarray]:
    """Per-KV-head slot lists (``[*shape, N]``: ``[layers, Hkv, N]``, or ``[Hkv, N]`` for one layer's
    selections), built in a few launches whatever the batch: list ``j`` (slot-table row ``rows[j]``)
    holds the positions of ``fixed[j]`` (``[n]`` or ``[..., Hkv, n]``; ``fixed`` one tensor ``[count, *shape, n]``
    or a sequence, -1 = padding), those above ``fixed_limit[j]`` (device; None: none) made padding, then when
    ``recent_from`` is given every position from ``recent_from[j]`` to ``last_positions[j]``. Also returns the
    lists' offsets (host)."""
    device = table.device
    if isinstance(fixed, torch.Tensor):  # one width for all: their concatenation is a reshape
        count, width = fixed.shape[0], fixed.shape[-1]
        source = fixed.expand(count, *shape, width).movedim(0, -2).reshape(*shape, count * width)
        fixed_lengths = np.full(count, width, dtype=np.int64)
    else:
        sources = [f.expand(*shape, -1) if f.dim() == 1 else f for f in fixed]
        source = torch.cat(sources, dim=-1)
        fixed_lengths = np.fromiter((f.shape[-1] for f in sources), np.int64, len(sources))
    source_starts = offsets(fixed_lengths)
    ends = last_positions + 1
    first_recent = ends if recent_from is None else recent_from  # None: no run
    recent_lengths = ends - first_recent
    lengths = fixed_lengths + recent_lengths
    indptr, fixed_starts, recent_starts = offsets(lengths), offsets(fixed_lengths), offsets(recent_lengths)
    meta = to_device(
        np.stack([rows, lengths, indptr[:-1], fixed_lengths, fixed_starts[:-1],
                  recent_lengths, recent_starts[:-1], first_recent, source_starts[:-1]]),
        device,
    )  # fmt: skip
    row, length, start, fixed_length, fixed_start, recent_length, recent_start, first_recent, source_start = meta
    total, total_fixed, total_recent = int(indptr[-1]), int(fixed_starts[-1]), int(recent_starts[-1])
    positions = torch.empty(*shape, total, dtype=torch.int64, device=device)
    owner = _owners(fixed_length, total_fixed)
    local = torch.arange(total_fixed, device=device) - fixed_start[owner]
    picked = source.to(device, torch.int64)[..., source_start[owner] + local]  # a policy keeps one device
    if fixed_limit is not None:  # nothing past the limit (K/V there is not this round's yet)
        picked = torch.where(picked > fixed_limit[owner], -1, picked)
    positions[..., start[owner] + local] = picked
    owner = _owners(recent_length, total_recent)
    local = torch.arange(total_recent, device=device) - recent_start[owner]
    positions[..., start[owner] + fixed_length[owner] + local] = first_recent[owner] + local
    entry_rows = torch.repeat_interleave(row, length, output_size=total)
    view = KVView(to_device(indptr, device), table.lookup(entry_rows, positions), int(lengths.max()))
    return view, indptr


def _owners(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """For each of ``total`` concatenated entries, the index of the list it belongs to."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths, output_size=total)


def offsets(lengths: np.ndarray) -> np.ndarray:
    """Start offsets of consecutive pieces of ``lengths`` items, and the total at the end."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


@dataclass
class DraftKeys:
    """The cached keys a query-aware policy that chooses on the host reads for one layer and one draft forward's
    requests (request ``j`` at slot-table row ``rows[j]``)."""

    table: SlotTable
    k_cache: torch.Tensor  # [slots, Hkv, D]
    rows: torch.Tensor  # [N] on the device

    def up_to(self, j: int, position: int) -> torch.Tensor:
        """Keys ``[position + 1, Hkv, D]`` of request ``j`` at positions 0 .. ``position``."""
        return self.k_cache[self.table.slots[self.rows[j], : position + 1]]


@dataclass
class DraftChoice:
    """A draft forward's requests as a policy that chooses on the device reads them (``DraftPolicy.choose_lists``),
    every value on the device (fixed addresses in a CUDA graph), so that choosing needs nothing from the host:
    request ``j`` at slot-table row ``rows[j]`` drafts at ``positions[j]``, reads every position from
    ``recent_start[j]`` on, makes its round's first choice where ``first[j]``, and may read at least ``floor[j]``
    positions (``min_budget``, the step's share). ``widths`` bound the step's lists (host ints: a graph's shapes)."""

    table: torch.Tensor  # SlotTable.slots [rows, positions]
    rows: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    recent_start: torch.Tensor  # [n]
    first: torch.Tensor  # [n] bool
    floor: torch.Tensor  # [n]
    widths: ChoiceWidths
    # The policy's choice for one layer: (this, layer, queries, scale, what the forward's layers share) -> the
    # lists (``DraftPolicy.choose_lists``).
    choose: Callable[[DraftChoice, int, torch.Tensor, float, dict], KVView]
    state: tuple[torch.Tensor, ...]  # what the choice reads and writes besides the table (a graph holds them)

    def lists(self, layer: int, queries: torch.Tensor, scale: float, shared: dict) -> KVView:
        return self.choose(self, layer, queries, scale, shared)

    def padded(self, size: int, positions: torch.Tensor) -> DraftChoice:
        """Fixed-address buffers for ``size`` requests (a graph's), reading ``positions``: padding requests
        choose nothing afresh (their lists are never read)."""
        zeros = torch.zeros(size, dtype=torch.int64, device=self.rows.device)
        first = torch.zeros(size, dtype=torch.bool, device=self.rows.device)
        return dataclasses.replace(
            self, rows=zeros, positions=positions, recent_start=zeros.clone(), first=first, floor=zeros.clone()
        )

    def copy_into(self, target: DraftChoice) -> None:
        """This forward's requests into the first rows of ``target``'s buffers (the rest: padding)."""
        count = self.rows.shape[0]
        for name in ("rows", "recent_start", "first", "floor"):
            buffer = getattr(target, name)
            buffer[:count] = getattr(self, name)
            buffer[count:] = 0

    def held_by(self, target: DraftChoice) -> bool:
        """Whether ``target`` (a graph's buffers) reads the same table and state, at widths that hold this one's."""
        same = target.table is self.table and all(a is b for a, b in zip(self.state, target.state, strict=True))
        return same and self.widths.fit_in(target.widths)


class ChoiceWidths(NamedTuple):
    """Bounds on a step's query-aware lists, known on the host: older positions a request may score (candidates),
    picks it may make (picks), recent positions it reads (recent), and whether some request makes its round's
    first choice (which keeps a shortlist). A graph keeps the widths it was captured with while a step's fit in
    them."""

    candidates: int
    picks: int
    recent: int
    any_first: bool

    def fit_in(self, other: ChoiceWidths) -> bool:
        return all(mine <= theirs for mine, theirs in zip(self, other, strict=True))


class DraftForward(NamedTuple):
    """One draft forward's requests in one layer, as a query-aware policy chooses for them: at ``positions``,
    with their queries ``[N, num_heads, head_dim]``, the layer's keys and its attention scale."""

    requests: Sequence[Request]
    positions: Sequence[int]
    layer: int
    queries: torch.Tensor
    keys: DraftKeys
    scale: float
