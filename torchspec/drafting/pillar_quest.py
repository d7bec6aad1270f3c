"""PillarQuest: half of the older budget from the previous verify's attention (PillarAttn), half from Quest pages
that this round's first draft query points at: the verify's scores are stale (the previous round's queries),
the first draft query is fresh, and its page bounds cost one read of the keys per round and layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchspec.config import SpecConfig
from torchspec.drafting.pillar import PillarPolicy
from torchspec.drafting.quest import PAGE_SIZE, page_bounds
from torchspec.drafting.sparsespec_l import DEFAULT_WINDOW
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request


class PillarQuestPolicy(PillarPolicy):
    """Per sparse layer and KV head, a draft step attends to the ``num_sinks`` first tokens, the recent window
    (``recent_window``, default 64) and every token written since the last verify; of the rest of the budget,
    half goes to the Top-K of the verify's attention mass (``on_verify``, as PillarAttn) and the other
    half to whole Quest pages, best page bound first, scored against the round's first draft query. The Quest
    pages are chosen once per round and layer, at its first draft step, and the round's later drafts reuse them
    (their own queries would pick fresher pages, but reading the page bounds at every draft costs a pass over
    the keys each). Quest counts only the positions a page adds to the sinks and the Top-K, so nothing is
    counted twice; rows of KV heads that end up with fewer positions are padded with -1."""

    name = "pillar_quest"
    selects_in_attention = True
    verify_share = 0.5

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.num_sinks = config.num_sinks
        self.window = config.recent_window or DEFAULT_WINDOW
        self.layer_index = {layer: i for i, layer in enumerate(self.sparse_layers)}

    def on_verifies(
        self,
        requests: Sequence[Request],
        mass: torch.Tensor | None,
        rows: Sequence[int],
        contexts: Sequence[int],
        first_query_positions: Sequence[int],
    ) -> None:
        super().on_verifies(requests, mass, rows, contexts, first_query_positions)
        for request in requests:
            request.round.selections = {}  # the next round's first draft chooses its pages afresh

    def select_positions(
        self, request: Request, position: int, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float
    ) -> torch.Tensor:
        selections = request.round.selections
        if layer not in selections:
            selections[layer] = self._select_older(request, position, layer, query, keys)
        return self.with_recent(request, position, selections[layer])

    def _select_older(
        self, request: Request, position: int, layer: int, query: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """The older positions (before ``recent_start``) of every draft of this round in ``layer``: the verify's
        sinks and Top-K plus the Quest pages that fit the rest of ``budget(position + 1)`` for the draft at
        ``position``; ``[num_kv_heads, n]``, sorted, -1 first in rows with fewer positions."""
        num_kv_heads, device = keys.shape[1], keys.device
        pattern, older = request.round.pattern, request.round.recent_start
        if pattern.dim() == 1:  # the verify's budget covered every older position
            return pattern.to(device).expand(num_kv_heads, -1)
        verify_picks = pattern[self.layer_index[layer]].to(device)  # [Hkv, n]: sinks and Top-K, -1 padding
        taken = torch.zeros(num_kv_heads, older + 1, dtype=torch.bool, device=device)
        taken.scatter_(1, torch.where(verify_picks >= 0, verify_picks, older), True)
        taken = taken[:, :older]
        room = self.request_budget(request, position + 1) - (position + 1 - older) - taken.sum(dim=-1)  # [Hkv]
        if older == 0 or int(room.max()) < 1:
            return verify_picks
        num_pages = -(-older // PAGE_SIZE)
        free = torch.nn.functional.pad(~taken, (0, num_pages * PAGE_SIZE - older)).reshape(num_kv_heads, num_pages, -1)
        new = free.sum(dim=-1)  # [Hkv, P]: positions each page would add
        bound = page_bounds(query, keys, older).masked_fill(new == 0, float("-inf"))
        order = bound.argsort(dim=-1, descending=True)
        # The best pages while their new positions fit the room (a prefix: the running sum only grows).
        fits = new.gather(1, order).cumsum(dim=-1) <= room[:, None]
        chosen = torch.zeros_like(fits).scatter_(1, order, fits)
        selected = taken | (chosen[..., None] & free).flatten(1)[:, :older]
        width = int(selected.sum(dim=-1).max())
        positions = torch.where(selected, torch.arange(older, device=device), -1)
        return positions.sort(dim=-1).values[:, older - width :]
