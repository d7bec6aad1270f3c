"""Query sketch: every draft's positions chosen from its own query, scored on the int4 key sketch, on the device.

PillarAttn picks a round's positions from the previous verify's attention, which goes stale as answers grow. One
set a round from the first draft query does not fix that (it falls behind from ~800 tokens of context on
SmolLM2), but choosing for every draft from its own query accepts what the oracle does (7.84 of 8 on an int4
sketch, docs/acceptance.md). Scoring every cached key exactly would cost a read of K each time; the KV pool's int4
sketch (``KVPool.codes``, 36 bytes a key and KV head where K takes 128) costs a fraction, and a shortlist less:
a round's first draft scores every older position, its later drafts rescore the best ``sketch_shortlist`` x
picks of that scoring (7.72 of 8 for ~1.27x a ``pillar_recent`` round's K/V-side reads).

A draft forward's requests choose together in a fixed number of device operations per layer, reading only the
device (positions, the slot table, the shortlists kept per slot-table row), so a forward that chooses is replayed
from CUDA graphs like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchspec.config import SpecConfig
from torchspec.draft_lists import ChoiceWidths, DraftChoice
from torchspec.drafting.base import DraftPolicy
from torchspec.drafting.pillar_recent import DEFAULT_WINDOW
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request
from torchspec.step import KVView


class QuerySketchPolicy(DraftPolicy):
    """Per sparse layer and KV head, a draft attends to the ``num_sinks`` first tokens, the recent window
    (``recent_window``, default 64) and every token written since the last verify, and within the rest of the
    budget to the positions of most attention mass (averaged over the GQA group's query heads) under the int4
    sketch's logits for its own query, each with its ``successors`` next positions (default none). A round's first
    draft scores every older position and keeps its best ``sketch_shortlist`` x picks (default 8; 0: every draft
    scores every older position), which its later drafts rescore."""

    name = "query_sketch"
    selects_in_attention = True
    chooses_on_device = True

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.num_sinks = config.num_sinks
        self.window = config.recent_window or DEFAULT_WINDOW
        self.span = config.successors + 1
        self.shortlist = config.sketch_shortlist
        self.sketched_layers = frozenset(self.sparse_layers)  # scored on the pool's copy, written as keys are stored
        self._layer_index = {layer: i for i, layer in enumerate(self.sparse_layers)}
        # Per sparse layer and slot-table row (one spare row last, which rows not choosing afresh write to): the
        # shortlist of the request's round ([layers, rows + 1, Hkv, width] positions as a Top-K lays them out: -1
        # first, its picks last in ascending order) and its length.
        self.shortlists = torch.zeros(0, 0, 0, 0, dtype=torch.int32)
        self.shortlist_lengths = torch.zeros(0, 0, dtype=torch.int64)

    def on_verifies(
        self,
        requests: Sequence[Request],
        mass: torch.Tensor | None,
        rows: Sequence[int],
        contexts: Sequence[int],
        first_query_positions: Sequence[int],
    ) -> None:
        """The next round reads every position from the window before the verify's queries on (of a prompt, its
        last k + 1, as PillarAttn scores them), and chooses its other positions afresh. The window takes at most
        half the budget, leaving room for picks."""
        for request, context, first_query in zip(requests, contexts, first_query_positions, strict=True):
            first = max(first_query, context - self.config.k - 1)
            window = min(self.window, self.budget(context) // 2)
            request.round.recent_start = max(0, first - window)
            request.round.chose = False

    def first_choices(self, requests: Sequence[Request]) -> list[bool]:
        """Which of a draft forward's requests make their round's first choice now (the others rescore its
        shortlist); all of them have chosen once it runs."""
        first = [not request.round.chose for request in requests]
        for request in requests:
            request.round.chose = True
        return first

    def widths(self, bound: int, recent: int, any_first: bool) -> ChoiceWidths:
        """The widths of a step's lists for requests of at most ``bound`` positions reading at most ``recent``
        recent positions: a first choice scores every older position, a later one its sinks and shortlist."""
        # A drained batch's step share can exceed any context: never more picks than positions.
        picks = min(max(self.budget(bound), 1), bound)
        # A shortlist made at a wider step share (the state keeps the widest) is rescored whole.
        rescored = self.num_sinks + max(self.shortlist * picks, self.shortlists.shape[-1] if self.shortlist else 0)
        candidates = bound if any_first or not self.shortlist else min(bound, rescored)
        return ChoiceWidths(candidates=candidates, picks=picks, recent=recent, any_first=any_first)

    def prepare(self, table_rows: int, widths: ChoiceWidths, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Room for the shortlists of ``table_rows`` slot-table rows at ``widths`` (kept: a graph that reads them
        is captured again when they move); returns them."""
        layers, heads = len(self.sparse_layers), self.num_kv_heads
        # Whole 16-byte rows: a kernel reading them keeps one alignment (one compiled variant) as widths grow.
        rows, width = table_rows + 1, -(-max(min(self.shortlist * widths.picks, widths.candidates), 1) // 4) * 4
        _, old_rows, _, old_width = self.shortlists.shape
        if self.shortlists.device == device and rows <= old_rows and width <= old_width:
            return self.shortlists, self.shortlist_lengths
        rows, width = max(rows, old_rows), max(width, old_width)
        grown = torch.full((layers, rows, heads, width), -1, dtype=torch.int32, device=device)
        lengths = torch.zeros(layers, rows, dtype=torch.int64, device=device)
        if self.shortlists.numel() and self.shortlists.device == device:  # a shortlist keeps its picks last
            grown[:, :old_rows, :, width - old_width :] = self.shortlists
            lengths[:, :old_rows] = self.shortlist_lengths
        self.shortlists, self.shortlist_lengths = grown, lengths
        return grown, lengths

    def choose_lists(
        self, choice: DraftChoice, layer: int, query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
        scale: float, shared: dict,
    ) -> KVView:  # fmt: skip
        """Each request's list for this layer (``[Hkv, n x width]``, -1 = padding; ``kv_ends`` where each ends):
        its sinks, its recent positions, then its picks with their successors; the first choices keep their
        shortlists. Three device operations a layer (scores, Top-K, lists; three more where a forward holds first
        choices, for their shortlists), on what the forward's requests share across layers (``_rounds``)."""
        rows, widths, heads = choice.rows, choice.widths, codes.shape[1]
        rounds = shared.get(self.name) or shared.setdefault(self.name, self._rounds(choice))
        index = self._layer_index[layer]
        listed, listed_lengths, lengths = self.shortlists[index], rounds.listed_lengths[index], rounds.lengths[index]
        grouped = query.reshape(rows.shape[0], heads, -1, query.shape[-1])
        mass = self.ops.sketch_mass(
            grouped, codes, scales, choice.table, rows, rounds.prefix, listed, listed_lengths, scale, rounds.sinks,
            widths.candidates,
        )  # fmt: skip
        picks = self.ops.top_k_positions(mass, rounds.count[:, None], widths.picks, lengths[:, None])
        slots, ends = self.ops.sketch_lists(
            picks, choice.table, rows, rounds.prefix, listed, listed_lengths, rounds.sinks, choice.recent_start,
            rounds.recent, self.span, rounds.width,
        )  # fmt: skip
        if widths.any_first and self.shortlist:  # the first choices keep their best (positions: a prefix's indices)
            best = self.ops.top_k_positions(mass, rounds.kept[:, None], listed.shape[-1], lengths[:, None])
            self.shortlists[index, rounds.keeps_in] = best
            self.shortlist_lengths[index, rounds.keeps_in] = rounds.kept
        return KVView(rounds.starts, slots, rounds.width, ends)

    def _rounds(self, choice: DraftChoice) -> _Rounds:
        """What every layer of a forward reads of its requests' rounds, computed once a forward. The shortlists'
        lengths are read for all layers at once: a layer writes only the first choices' (which read none)."""
        older, first, widths = choice.recent_start, choice.first, choice.widths
        sinks = older.clamp(max=self.num_sinks)
        context = choice.positions + 1
        budget = torch.maximum(choice.floor, (context.double() * self.config.sparsity).ceil().long())
        room = budget - (context - older) - sinks
        spare = older - sinks  # older positions that may be picked
        count = torch.where(room >= spare, spare, (room // self.span).clamp(min=1)).masked_fill(room <= 0, 0)
        # A request rescoring its shortlist scores its sinks (they weigh in the softmax, never picked), then it.
        rescores = ~first if self.shortlist else torch.zeros_like(first)
        prefix = torch.where(rescores, sinks, older)
        listed_lengths = torch.where(rescores, self.shortlist_lengths[:, choice.rows], 0)  # [layers, n]
        width = self.num_sinks + widths.recent + widths.picks * self.span
        return _Rounds(
            sinks=sinks,
            prefix=prefix,
            count=count,
            listed_lengths=listed_lengths,
            lengths=prefix + listed_lengths,
            kept=torch.minimum(count * self.shortlist, spare),
            # The first choices' shortlists go to their rows, the others' to the spare row.
            keeps_in=torch.where(first, choice.rows, self.shortlists.shape[1] - 1),
            # A request past its chain in a chain's later forward, or padding, drafts at position 0: none recent.
            recent=(context - older).clamp(0, widths.recent),
            width=width,
            starts=torch.arange(first.shape[0] + 1, device=first.device) * width,
        )


@dataclass
class _Rounds:
    """A forward's requests as every layer chooses for them (``[n]`` each, ``[sparse layers, n]`` by layer)."""

    sinks: torch.Tensor  # sinks read (and scored, never picked)
    prefix: torch.Tensor  # older positions scored as a prefix: all of them at a first choice, else the sinks
    count: torch.Tensor  # picks to make
    listed_lengths: torch.Tensor  # by layer: the shortlist entries rescored (0 at a first choice)
    lengths: torch.Tensor  # by layer: candidates scored
    kept: torch.Tensor  # a first choice's shortlist length
    keeps_in: torch.Tensor  # the shortlist row a first choice writes
    recent: torch.Tensor  # recent positions read, from the recent start
    width: int  # entries of a list
    starts: torch.Tensor  # [n + 1]: where each list starts
