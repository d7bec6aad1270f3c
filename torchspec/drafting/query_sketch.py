"""Query sketch: a round's positions chosen from its own draft queries, scored on a compact key sketch.

PillarAttn picks a round's positions from the previous verify's attention, which goes stale as answers grow. In
the engine one set a round from the first draft query does not fix that (it falls behind from ~800 tokens of
context on SmolLM2), but choosing for every draft from its own query accepts what the oracle does (7.84 of 8 on
an int4 sketch, docs/acceptance.md). Scoring every cached key exactly would cost a read of K each time; a sketch
(``torchspec.key_sketch``) costs a few bytes a key instead, and a shortlist fewer keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from torchspec.config import SpecConfig
from torchspec.drafting.base import DraftPolicy
from torchspec.drafting.pillar import expand_successors
from torchspec.drafting.pillar_recent import DEFAULT_WINDOW
from torchspec.key_sketch import KEY_SKETCHES
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request


class _Selection(NamedTuple):
    """What a draft chose in one layer: for itself and the drafts after it until the next refresh."""

    position: int  # of the draft that chose
    older: torch.Tensor  # sinks and picks, [num_kv_heads, n]
    shortlist: torch.Tensor | None = None  # positions the round's later choices rescore, [num_kv_heads, m]


class QuerySketchPolicy(DraftPolicy):
    """Per sparse layer and KV head, a round's drafts attend to the ``num_sinks`` first tokens, the recent window
    (``recent_window``, default 64) and every token written since the last verify, and within the rest of the
    budget to the positions of most attention mass (averaged over the GQA group's query heads) under the
    sketch's logits for the round's first draft query, each with its ``successors`` next positions (default
    none). Chosen once a round and layer, at the first draft, and the round's later drafts reuse them; or
    afresh every ``sketch_refresh`` drafts from the query of the draft that reaches it (scoring only the first
    choice's ``sketch_shortlist`` x picks best positions, when set). What a sketch learns from the prompt
    (``fit``) is kept per request and layer in its round ``pattern``."""

    name = "query_sketch"
    selects_in_attention = True

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.sketch = KEY_SKETCHES[config.key_sketch]
        self.num_sinks = config.num_sinks
        self.window = config.recent_window or DEFAULT_WINDOW
        self.successors = config.successors
        self.refresh = config.sketch_refresh or config.k
        self.shortlist = config.sketch_shortlist

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
            request.round.selections = {}

    def select_positions(
        self, request: Request, position: int, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float
    ) -> torch.Tensor:
        selections = request.round.selections
        made = selections.get(layer)
        if made is None or position - made.position >= self.refresh:
            shortlist = None if made is None else made.shortlist
            selections[layer] = self._select_older(request, position, layer, query, keys, scale, shortlist)
        return self.with_recent(request, position, selections[layer].older)

    def _select_older(
        self,
        request: Request,
        position: int,
        layer: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        scale: float,
        shortlist: torch.Tensor | None,
    ) -> _Selection:
        """The sinks and picks among the positions before ``recent_start`` (``[num_kv_heads, n]``, -1 =
        padding), scored among ``shortlist`` when given, else among all of them (then keeping the best
        ``sketch_shortlist`` x picks as the round's shortlist)."""
        num_kv_heads, device = keys.shape[1], keys.device
        older = request.round.recent_start
        sinks = min(self.num_sinks, older)
        room = self.budget(position + 1) - (position + 1 - older) - sinks
        if room >= older - sinks:  # the budget holds every older position
            return _Selection(position, torch.arange(older, device=device).expand(num_kv_heads, -1))
        sink_positions = torch.arange(sinks, device=device).expand(num_kv_heads, -1)
        if room <= 0:
            return _Selection(position, sink_positions)
        span = self.successors + 1
        scored = torch.arange(older, device=device).expand(num_kv_heads, -1)
        if shortlist is not None:  # the sinks too: they weigh in each query head's softmax
            scored = torch.cat([sink_positions, shortlist], dim=-1)
        grouped = query.reshape(num_kv_heads, -1, query.shape[-1])  # [Hkv, G, D]
        scored_keys = keys[scored, torch.arange(num_kv_heads, device=device)[:, None]].transpose(0, 1)  # [S, Hkv, D]
        logits = self.sketch.logits(grouped, scored_keys, self._fitted(request, layer, keys)) * scale
        mass = logits.softmax(dim=-1).mean(dim=1)[:, sinks:]  # [Hkv, candidates]
        candidates = scored[:, sinks:]
        count = max(1, room // span)
        picks = candidates.gather(1, mass.topk(count, dim=-1).indices)
        if shortlist is None and self.shortlist:
            best = mass.topk(min(mass.shape[-1], self.shortlist * count), dim=-1).indices
            shortlist = candidates.gather(1, best)
        older_positions = torch.cat([sink_positions, expand_successors(picks, span, older)], dim=-1)
        return _Selection(position, older_positions, shortlist)

    def _fitted(self, request: Request, layer: int, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the sketch learned from the request's prompt keys in ``layer``, fitted at its first round."""
        if request.round.pattern is None:
            request.round.pattern = {}
        fitted = request.round.pattern
        if layer not in fitted:
            fitted[layer] = self.sketch.fit(keys[: max(1, min(request.num_prompt_tokens, keys.shape[0]))])
        return fitted[layer]
