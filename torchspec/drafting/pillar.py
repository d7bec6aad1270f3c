"""PillarAttn: draft steps attend to the tokens the previous verify found most attended, per layer and head."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from torchspec.config import SpecConfig
from torchspec.drafting.base import DraftPolicy
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request


class PillarPolicy(DraftPolicy):
    """Top-K over the verify step's exact attention mass (averaged over its queries and each GQA group's query
    heads), per (layer, KV head); the tokens written since that verify, and the ``recent_window`` tokens
    before it, are always included on top."""

    name = "pillar"
    uses_verify_scores = True
    #: Fraction of the older budget (after sinks) the verify Top-K takes; a subclass may leave the rest to
    #: another selection (PillarQuest: Quest pages chosen by the round's first draft query).
    verify_share: ClassVar[float] = 1.0

    def ready(self, request: Request) -> bool:
        return request.round.pattern is not None

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.num_sinks = 0  # first tokens always kept (the paper keeps none)
        self.window = config.recent_window
        self.successors = config.successors

    def on_verify(self, request: Request, mass: torch.Tensor | None, first_query_position: int) -> None:
        # Positions before the verify's queries and the recent window compete for the rest of the budget. The
        # window takes at most half the budget (small budgets keep room for Top-K picks) and shrinks when the
        # budget cannot hold it next to the verify's queries.
        context = mass.shape[-1] if mass is not None else first_query_position
        budget = self.budget(context)
        window = min(self.window, budget // 2, max(0, budget - (context - first_query_position)))
        older = max(0, first_query_position - window)
        super().on_verify(request, mass, older)
        sinks = min(self.num_sinks, older)
        num_selected = min(older - sinks, max(0, budget - (context - older) - sinks))
        device = mass.device if mass is not None else None
        if num_selected == older - sinks or mass is None:  # the budget covers it all, or no layer drafts sparsely
            request.round.pattern = torch.arange(older, device=device)
            return
        num_selected = int(num_selected * self.verify_share)
        scores = mass[..., sinks:older]  # [layers, Hkv, candidates]
        span = self.successors + 1
        count = max(1, num_selected // span) if num_selected else 0
        picks = _head_budget_picks(scores, count) if self.config.head_budgets else scores.topk(count, dim=-1).indices
        pattern = _expand_successors(torch.where(picks >= 0, picks + sinks, -1), span, older)
        if sinks:
            sink_positions = torch.arange(sinks, device=device).expand(*pattern.shape[:2], -1)
            pattern = torch.cat([sink_positions, pattern], dim=-1)
        request.round.pattern = pattern  # stays on the device: the runner builds draft lists there

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
    return positions.sort(dim=-1, descending=True).values[..., :width]


def _expand_successors(picks: torch.Tensor, span: int, limit: int) -> torch.Tensor:
    """Each pick and the ``span - 1`` positions after it, sorted per row; positions >= ``limit``, repeats and
    the successors of -1 picks become -1 (padding that attention skips), so every row keeps the same length."""
    if span == 1:
        return picks.sort(dim=-1).values
    positions = torch.where(picks[..., None] >= 0, picks[..., None] + torch.arange(span, device=picks.device), -1)
    positions = positions.flatten(-2).sort(dim=-1).values
    repeated = torch.zeros_like(positions, dtype=torch.bool)
    repeated[..., 1:] = positions[..., 1:] == positions[..., :-1]
    return torch.where(repeated | (positions >= limit), -1, positions)
