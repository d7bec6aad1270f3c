"""PillarAttn: draft steps attend to the tokens the previous verify found most attended, per layer and head."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from torchspec.config import SpecConfig
from torchspec.drafting.base import DraftPolicy
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request
from torchspec.transfer import row_index, to_device

MAX_SCORE_ELEMENTS = 1 << 26  # padded candidate scores of one batched Top-K (256 MiB of fp32); larger: chunks


class PillarPolicy(DraftPolicy):
    """Top-K over the verify step's attention mass (its queries' attention relative to the sink or the newest
    token, summed over them and each GQA group's query heads; see ``attention.reference.paged_attention``), per
    (layer, KV head); the tokens written since that verify, and the ``recent_window`` tokens before it, are always
    included on top."""

    name = "pillar"
    uses_verify_scores = True
    #: Fraction of the older budget (after sinks) the verify Top-K takes; a subclass may leave the rest to
    #: another selection (PillarQuest: Quest pages chosen by the round's first draft query).
    verify_share: ClassVar[float] = 1.0

    def ready(self, request: Request) -> bool:
        return request.round.pattern is not None

    def learns_from_round(self, request: Request) -> bool:
        """One round in every ``relearn_rounds`` (counted by the rounds the request has verified: with rounds
        launched ahead, one in flight is not counted yet, the same offset at every round), and any round a
        plain step would learn from (no pattern yet, or a recent run as long as a budget)."""
        every = request.spec_stats.num_rounds % self.config.relearn_rounds == 0
        return every or self.learns_from_plain_step(request)

    def learns_from_plain_step(self, request: Request) -> bool:
        """Only once the pattern is missing or the recent run (every position from ``recent_start``, which
        every draft reads on top of the pattern) has grown to a whole budget: a Top-K over every older
        position, and the mass pass it then took, cost a full-batch plain step on W1 ~9 of its 21 ms, and a
        pattern some tokens old drafts about as well. Draft lists stay within about twice the budget."""
        if request.round.pattern is None:
            return True
        position = request.num_computed_tokens
        return position - request.round.recent_start >= self.request_budget(request, position + 1)

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.num_sinks = 0  # first tokens always kept (the paper keeps none)
        self.window = config.recent_window
        self.successors = config.successors

    def on_verify(self, request: Request, mass: torch.Tensor | None, first_query_position: int) -> None:
        context = mass.shape[-1] if mass is not None else first_query_position
        as_row = None if mass is None else mass[..., None, :]  # [layers, Hkv, 1 verify, context]
        self.on_verifies([request], as_row, [0], [context], [first_query_position])

    def on_verifies(
        self,
        requests: Sequence[Request],
        mass: torch.Tensor | None,
        rows: Sequence[int],
        contexts: Sequence[int],
        first_query_positions: Sequence[int],
    ) -> None:
        """Every request's pattern from one Top-K over the step's verifies (their rows of the mass, cut to the
        longest candidate run), so the device work per step does not grow with the number of verifies."""
        covered, picked = [], []  # (request, older); (request, mass row, sinks, older, picks to make)
        for request, row, context, first_query in zip(requests, rows, contexts, first_query_positions, strict=True):
            # Positions before the verify's queries and the recent window compete for the rest of the budget.
            # The window takes at most half the budget (small budgets keep room for Top-K picks) and shrinks
            # when the budget cannot hold it next to the verify's queries.
            if mass is None:  # no layer drafts sparsely: nothing was scored, the verify's queries bound it
                context = first_query
            budget = self.request_budget(request, context)
            window = min(self.window, budget // 2, max(0, budget - (context - first_query)))
            older = max(0, first_query - window)
            request.round.recent_start = older
            sinks = min(self.num_sinks, older)
            num_selected = min(older - sinks, max(0, budget - (context - older) - sinks))
            if num_selected == older - sinks or mass is None:  # the budget covers it all, or no sparse layer
                covered.append((request, older))
                continue
            share = int(num_selected * self.verify_share)
            count = max(1, share // (self.successors + 1)) if share else 0
            picked.append((request, row, sinks, older, count))
        device = mass.device if mass is not None else None
        if covered:
            everything = torch.arange(max(older for _, older in covered), device=device)
            for request, older in covered:
                request.round.pattern = everything[:older]
        if not picked:
            return
        if _in_place(picked):  # the mass rows themselves are the scores: nothing is copied, one Top-K does all
            chunk = len(picked)
        else:
            chunk = max(1, MAX_SCORE_ELEMENTS // (mass.shape[0] * mass.shape[1] * max(o for _, _, _, o, _ in picked)))
        for first in range(0, len(picked), chunk):
            self._select_patterns(mass, picked[first : first + chunk])

    def _select_patterns(self, mass: torch.Tensor, picked: list[tuple[Request, int, int, int, int]]) -> None:
        """Top-K of each request's candidates (positions ``sinks .. older - 1``), as its sorted pattern."""
        device = mass.device
        requests, rows, sinks, older, counts = zip(*picked, strict=True)
        span = self.successors + 1
        if self.config.head_budgets:  # per request: its own Top-K over all heads of a layer
            for request, row, sink, old, count in picked:
                picks = _head_budget_picks(mass[..., row, sink:old], count)
                self._store(request, expand_successors(torch.where(picks >= 0, picks + sink, -1), span, old), sink)
            return
        meta = to_device([sinks, older, counts], device)
        sink, old, count = (column[:, None] for column in meta)  # [J, 1]
        # The requests' rows, cut to the longest candidate run: a view when they are consecutive (every verify
        # of the step learns), else one gather.
        scores = mass[:, :, row_index(list(rows), device), : max(older)]  # [layers, Hkv, J, width]
        lengths = old[:, 0]  # a row's candidates end where its recent window starts: the Top-K reads no further
        if any(sinks):  # and start after its sinks: those before are masked (a copy of the scores)
            scores = scores.masked_fill(torch.arange(scores.shape[-1], device=device) < sink, float("-inf"))
        # [J, layers, Hkv, max count]: each row's picks in ascending order after its -1 padding, a pattern already.
        picks = self.ops.top_k_positions(scores, count[:, 0], max(counts), lengths).permute(2, 0, 1, 3)
        patterns = picks if span == 1 else expand_successors(picks, span, old[:, :, None, None])
        # Each request's rows trimmed to its own Top-K: one unbind, then a view only where a request picks fewer
        # than the widest (at a full batch of equal budgets, none does). An unbind per distinct width made
        # 256 views per width: with budgets as varied as their contexts or weights, ~14 ms of host a round.
        full_width = patterns.shape[-1]
        for pattern, request, num_picks, num_sinks in zip(patterns.unbind(0), requests, counts, sinks, strict=True):
            width = num_picks * span
            self._store(
                request, pattern if width == full_width else pattern.narrow(-1, full_width - width, width), num_sinks
            )

    @staticmethod
    def _store(request: Request, pattern: torch.Tensor, sinks: int) -> None:
        """The round's pattern: the sinks (when any) then the picks; stays on the device, where the runner
        builds the draft lists."""
        if sinks:
            sink_positions = torch.arange(sinks, device=pattern.device).expand(*pattern.shape[:2], -1)
            pattern = torch.cat([sink_positions, pattern], dim=-1)
        request.round.pattern = pattern

    def draft_positions(self, request: Request, position: int) -> tuple[torch.Tensor, int]:
        return request.round.pattern, request.round.recent_start


def _head_budget_picks(scores: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` picks per KV head on average, shared out across a layer's heads by one Top-K over all of them
    (the split that keeps the most attention mass: a head whose attention is concentrated gives its unused
    share to a diffuse one). Rows are padded with -1 to the layer's longest: ``[layers, Hkv, width]``."""
    layers, heads, candidates = scores.shape
    flat = scores.flatten(1).topk(min(count * heads, heads * candidates), dim=-1).indices  # [layers, picks]
    chosen = torch.zeros(layers, heads * candidates, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, flat, True)
    chosen = chosen.view(layers, heads, candidates)
    width = int(chosen.sum(dim=-1).max())
    positions = torch.where(chosen, torch.arange(candidates, device=scores.device), -1)
    return positions.sort(dim=-1).values[..., positions.shape[-1] - width :]  # ascending after the -1 padding


def expand_successors(picks: torch.Tensor, span: int, limit: int | torch.Tensor) -> torch.Tensor:
    """Each pick and the ``span - 1`` positions after it, ascending along the row; positions >= ``limit``, those
    a lower pick already brought and the successors of -1 picks become -1 (padding that attention skips, anywhere
    in a row), so every row keeps the same length. ``picks`` come ascending after their -1 padding (the order of
    ``top_k_positions``), so only the pick just before can have brought a position already: no sort (a radix sort
    of W1's 23,040 rows took ~0.45 ms a round on an H100)."""
    if span == 1:
        return picks
    successors = torch.arange(span, dtype=picks.dtype, device=picks.device)
    positions = picks[..., None] + successors  # [..., picks, span]
    previous = torch.nn.functional.pad(picks[..., :-1], (1, 0), value=-1)  # the pick before each (-1: none)
    covered_to = torch.where(previous >= 0, previous + span - 1, -1)  # the last position it brought
    below = positions < (limit[..., None] if isinstance(limit, torch.Tensor) else limit)
    kept = (picks[..., None] >= 0) & (positions > covered_to[..., None]) & below
    return torch.where(kept, positions, -1).flatten(-2)


def _in_place(picked: list[tuple[Request, int, int, int, int]]) -> bool:
    """Whether one Top-K reads every request's candidates where they lie in the verify mass: no sinks to mask and
    consecutive rows (a run of the step's verifies, usually all of them), so the scores are a view of evenly spaced
    rows that needs no bound on its size (``top_k_positions`` reads it in place)."""
    rows = [row for _, row, _, _, _ in picked]
    return not any(sinks for _, _, sinks, _, _ in picked) and rows == list(range(rows[0], rows[0] + len(rows)))
