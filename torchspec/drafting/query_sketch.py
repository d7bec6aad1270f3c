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

import numpy as np
import torch

from attention.reference import group_mass
from torchspec.config import SpecConfig
from torchspec.draft_lists import DraftForward, DraftKeys
from torchspec.drafting.base import DraftPolicy
from torchspec.drafting.pillar import expand_successors
from torchspec.drafting.pillar_recent import DEFAULT_WINDOW
from torchspec.key_sketch import KEY_SKETCHES
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request
from torchspec.transfer import to_device

#: A round's later choices rescore this many times their picks from its first draft's scoring, by default: 7.72
#: accepted of 8 (7.84 rescoring everything) for ~1.27x a pillar_recent round's K/V-side reads (docs/acceptance.md).
DEFAULT_SHORTLIST = 8


class _Choice(NamedTuple):
    """What one choice made for several requests of a draft forward together, one row each: their sinks and picks
    ``[n, Hkv, c]`` and the shortlists the round's later choices rescore ``[n, Hkv, m]`` (-1 = padding)."""

    older: torch.Tensor
    shortlist: torch.Tensor | None = None


class _Selection(NamedTuple):
    """A request's choice in one layer, serving its draft and those after it until the next refresh: row ``row``
    of ``choice`` (a reference, not a copy: a forward of hundreds of requests slices nothing per request)."""

    position: int  # of the draft that chose
    choice: _Choice
    row: int


class QuerySketchPolicy(DraftPolicy):
    """Per sparse layer and KV head, a round's drafts attend to the ``num_sinks`` first tokens, the recent window
    (``recent_window``, default 64) and every token written since the last verify, and within the rest of the
    budget to the positions of most attention mass (averaged over the GQA group's query heads) under the
    sketch's logits for a draft's own query, each with its ``successors`` next positions (default none). Chosen
    afresh every ``sketch_refresh`` drafts (default: every draft; 0: once a round, at its first) from the query
    of the draft that reaches it, the round's later choices among the ``sketch_shortlist`` x picks best positions
    of its first (default 8x). A draft forward's requests choose together, in a fixed number of device
    operations. What a sketch learns from the prompt (``fit``) is kept per request and layer in its round
    ``pattern``."""

    name = "query_sketch"
    selects_in_attention = True

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.sketch = KEY_SKETCHES[config.key_sketch]
        self.num_sinks = config.num_sinks
        self.window = config.recent_window or DEFAULT_WINDOW
        self.successors = config.successors
        self.refresh = config.sketch_refresh or config.k
        chooses_again = 0 < config.sketch_refresh < config.k
        shortlist = config.sketch_shortlist
        self.shortlist = shortlist if shortlist is not None else DEFAULT_SHORTLIST * chooses_again
        if self.sketch.stored:  # scored on the pool's copy, written as keys are stored
            self.sketched_layers = frozenset(self.sparse_layers)

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

    def select_for_drafts(self, forward: DraftForward) -> tuple[torch.Tensor, np.ndarray]:
        requests, positions, layer = forward.requests, forward.positions, forward.layer
        stale = [
            j
            for j, (request, position) in enumerate(zip(requests, positions, strict=True))
            if layer not in request.round.selections
            or position - request.round.selections[layer].position >= self.refresh
        ]
        if stale:
            self._choose(forward, stale)
        recent_from = np.fromiter((request.round.recent_start for request in requests), np.int64, len(requests))
        selections = [request.round.selections[layer] for request in requests]
        return _gathered(selections, "older", forward.keys.k_cache.device), recent_from

    def _choose(self, forward: DraftForward, stale: list[int]) -> None:
        """Each ``stale`` request's sinks and picks among its positions before ``recent_start``: all of them
        where the budget holds them, the sinks alone where it holds no pick, else scored on the sketch (among
        its shortlist when it has one, else among all of them, then keeping its best ``sketch_shortlist`` x
        picks as the round's shortlist)."""
        requests, positions, layer = forward.requests, forward.positions, forward.layer
        whole, scored = [], []
        for j in stale:
            older = requests[j].round.recent_start
            sinks = min(self.num_sinks, older)
            room = self.budget(positions[j] + 1) - (positions[j] + 1 - older) - sinks
            (whole if room >= older - sinks or room <= 0 else scored).append((j, older, sinks, room))
        if whole:
            kept = [older if room > 0 else sinks for _, older, sinks, room in whole]
            num_kv_heads, device = forward.keys.k_cache.shape[1], forward.keys.k_cache.device
            lengths = to_device(kept, device)[:, None, None]
            self._keep(forward, [entry[0] for entry in whole], _Choice(_prefixes(lengths, max(kept), num_kv_heads)))
        groups: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}  # among a shortlist, or all
        for entry in scored:
            groups[self._shortlist(requests[entry[0]], layer) is not None].append(entry)
        for group in (groups[False], groups[True]):
            if group:
                self._score(forward, group)

    @staticmethod
    def _keep(forward: DraftForward, index: Sequence[int], choice: _Choice) -> None:
        """Request ``index[i]`` of the forward keeps row ``i`` of ``choice`` in the forward's layer."""
        requests, positions, layer = forward.requests, forward.positions, forward.layer
        for row, j in enumerate(index):
            requests[j].round.selections[layer] = _Selection(positions[j], choice, row)

    def _score(self, forward: DraftForward, scored: list[tuple[int, int, int, int]]) -> None:
        """Sketch scores, Top-K and successors of the requests ``scored`` (index, older positions, sinks,
        room), all together, each at its round's first choice or each among its shortlist: the candidates
        ``[n, Hkv, S]`` (-1 = padding) hold the sinks first, which weigh in each query head's softmax and are
        never picked."""
        requests, _, layer, queries, keys, scale = forward
        num_kv_heads, device = keys.k_cache.shape[1], keys.k_cache.device
        index, older, sinks, room = (list(column) for column in zip(*scored, strict=True))
        span = self.successors + 1
        counts = [max(1, r // span) for r in room]
        on_device = to_device([older, sinks, counts], device)[..., None, None]
        older_t, sinks_t, counts_t = on_device
        first_choice = self._shortlist(requests[index[0]], layer) is None  # all first choices, or all among shortlists
        sink_positions = _prefixes(sinks_t, max(sinks), num_kv_heads)
        if first_choice:
            candidates = _prefixes(older_t, max(older), num_kv_heads)
        else:
            shortlists = [requests[j].round.selections[layer] for j in index]
            candidates = torch.cat([sink_positions, _gathered(shortlists, "shortlist", device)], dim=-1)
        grouped = queries[index].reshape(len(index), num_kv_heads, -1, queries.shape[-1])  # [n, Hkv, G, D]
        rows = to_device(index, device)
        # The sinks lead each row (a shortlist's, padded to the most sinks): they weigh in, never picked.
        skip = sinks_t.flatten() if first_choice else torch.full_like(sinks_t.flatten(), max(sinks))
        if keys.codes is not None:
            slots = keys.slots_at(rows, candidates)
            mass = self.ops.sketch_mass(grouped, keys.codes, keys.scales, slots, scale, skip)  # [n, Hkv, S]
        else:  # a sketch of the study, computed from the full keys
            fitted = self._fitted([requests[j] for j in index], index, layer, keys)
            logits = self.sketch.logits(grouped, keys.at(rows, candidates), fitted) * scale
            mass = group_mass(logits, candidates >= 0, skip)
        picks = _positions(candidates, self.ops.top_k_positions(mass, counts_t[..., 0], max(counts)))
        chosen = torch.cat([sink_positions, expand_successors(picks, span, older_t)], dim=-1)
        shortlist = None
        if self.shortlist and first_choice:
            sizes = [self.shortlist * count for count in counts]
            best = self.ops.top_k_positions(mass, counts_t[..., 0] * self.shortlist, max(sizes))
            shortlist = _positions(candidates, best)
            shortlist = torch.where(shortlist >= sinks_t, shortlist, -1)  # a short row's ties at -1: no sinks
        self._keep(forward, index, _Choice(chosen, shortlist))

    @staticmethod
    def _shortlist(request: Request, layer: int) -> torch.Tensor | None:
        made = request.round.selections.get(layer)
        return None if made is None else made.choice.shortlist

    def _fitted(
        self, requests: Sequence[Request], index: Sequence[int], layer: int, keys: DraftKeys
    ) -> tuple[torch.Tensor, ...]:
        """What the sketch learned from each request's prompt keys in ``layer`` (fitted at its first round),
        stacked."""
        fits = []
        for request, j in zip(requests, index, strict=True):
            if request.round.pattern is None:
                request.round.pattern = {}
            if layer not in request.round.pattern:
                prompt = keys.up_to(j, max(0, request.num_prompt_tokens - 1))
                request.round.pattern[layer] = self.sketch.fit(prompt)
            fits.append(request.round.pattern[layer])
        return tuple(torch.stack(parts) for parts in zip(*fits, strict=True))


def _positions(candidates: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The candidates' positions at indices ``chosen`` (``[n, Hkv, k]``, -1 = padding, kept)."""
    return torch.where(chosen >= 0, candidates.gather(-1, chosen.clamp(min=0).long()), -1)


def _prefixes(lengths: torch.Tensor, width: int, num_kv_heads: int) -> torch.Tensor:
    """``[n, Hkv, width]``: row ``i`` holds positions ``0 .. lengths[i] - 1`` in every head, then -1 (``lengths``
    ``[n, 1, 1]`` on the device, none above ``width``)."""
    positions = torch.arange(width, device=lengths.device).expand(lengths.shape[0], num_kv_heads, -1)
    return torch.where(positions < lengths, positions, -1)


def _gathered(selections: Sequence[_Selection], part: str, device: torch.device) -> torch.Tensor:
    """The ``part`` (``older`` or ``shortlist``) rows of ``selections`` as one ``[n, Hkv, width]`` tensor (-1 =
    padding at the end): the choice itself where the selections are its rows in order (a forward whose requests
    all chose together), else a copy per choice they come from."""
    first = selections[0].choice
    if all(s.choice is first and s.row == row for row, s in enumerate(selections)):
        return getattr(first, part)[: len(selections)]  # a chain's later forwards run a prefix of its requests
    sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # choice -> (part, its rows, our rows)
    for at, selection in enumerate(selections):
        tensor = getattr(selection.choice, part)
        _, rows, ours = sources.setdefault(id(selection.choice), (tensor, [], []))
        rows.append(selection.row)
        ours.append(at)
    width = max(tensor.shape[-1] for tensor, _, _ in sources.values())
    out = torch.full((len(selections), first.older.shape[1], width), -1, dtype=torch.int64, device=device)
    for tensor, rows, ours in sources.values():
        index = to_device([ours, rows], device)
        out[index[0], :, : tensor.shape[-1]] = tensor[index[1]].long()
    return out
