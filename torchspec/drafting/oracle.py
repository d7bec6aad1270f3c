"""Oracle: Top-K from the draft query's own exact attention. An analysis bound, not a real draft: finding
these tokens costs the full attention the draft is meant to avoid."""

from __future__ import annotations

import torch

from torchspec.drafting.base import DraftPolicy
from torchspec.request import Request


class OraclePolicy(DraftPolicy):
    """Each draft step attends to the tokens its own query attends to most (exact softmax mass, averaged over
    the GQA group's query heads), per layer and KV head, plus the tokens written since the last verify."""

    name = "oracle"
    selects_in_attention = True

    def select_positions(
        self, request: Request, position: int, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float
    ) -> torch.Tensor:
        older, count = self.num_older(request, position)
        num_kv_heads = keys.shape[1]
        grouped = query.float().reshape(num_kv_heads, -1, query.shape[-1])  # [Hkv, G, D]
        logits = torch.einsum("hgd,lhd->hgl", grouped, keys.float()) * scale
        mass = logits.softmax(dim=-1).mean(dim=1)[:, :older]  # [Hkv, older]
        return self.with_recent(request, position, mass.topk(count, dim=-1).indices)
