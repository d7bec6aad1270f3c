"""Streaming (MagicDec-style): attention sinks plus the most recent tokens, at the same budget."""

from __future__ import annotations

import torch

from torchspec.drafting.base import DraftPolicy
from torchspec.request import Request


class StreamingPolicy(DraftPolicy):
    """The first ``num_sinks`` tokens and a window of the latest ones; the same for every layer and head. The
    window is the round's first draft's: a later draft of the round also reads the drafts before it."""

    name = "streaming"

    def draft_positions(self, request: Request, position: int) -> tuple[torch.Tensor, int]:
        context = position + 1
        budget = self.request_budget(request, context)
        if budget >= context:
            return torch.arange(0), 0
        sinks = min(self.config.num_sinks, budget)
        return torch.arange(sinks), context - (budget - sinks)
