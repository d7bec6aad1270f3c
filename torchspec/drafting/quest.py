"""Quest: query-aware page selection by an upper bound of q.k from per-page key minima and maxima."""

from __future__ import annotations

import torch

from torchspec.drafting.base import DraftPolicy
from torchspec.request import Request

PAGE_SIZE = 16


class QuestPolicy(DraftPolicy):
    """Pages of 16 positions keep the element-wise min and max of their keys; a page's score for a query head
    is ``sum_d max(q_d * min_d, q_d * max_d)`` (no key in the page can score higher); each KV head takes the
    best pages by the maximum over its query heads, within the same budget (whole pages, at least one), plus
    the recent tokens."""

    name = "quest"
    selects_in_attention = True

    def select_positions(
        self, request: Request, position: int, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float
    ) -> torch.Tensor:
        older, count = self.num_older(request, position)
        num_kv_heads = keys.shape[1]
        num_pages = -(-older // PAGE_SIZE)
        if count == 0 or num_pages == 0:
            return self.with_recent(request, position, torch.zeros(num_kv_heads, 0, dtype=torch.int64))
        bound = page_bounds(query, keys, older)  # [Hkv, P]
        pages_in_budget = num_pages if count >= older else max(1, count // PAGE_SIZE)
        best = bound.topk(min(num_pages, pages_in_budget), dim=-1).indices  # [Hkv, pages]
        positions = (best[..., None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=best.device)).flatten(1)
        # The last page may be partial: its missing positions become -1 (padding, skipped by attention).
        return self.with_recent(request, position, torch.where(positions < older, positions, -1))


def page_bounds(query: torch.Tensor, keys: torch.Tensor, length: int) -> torch.Tensor:
    """Quest's page scores over the first ``length`` positions (pages of ``PAGE_SIZE``, the last may be
    partial): per KV head, the largest ``sum_d max(q_d * min_d, q_d * max_d)`` over its GQA group's query heads,
    from the element-wise key minima and maxima of each page, so no key of a page can score higher. ``query``
    is ``[num_heads, head_dim]``, ``keys`` ``[>= length, num_kv_heads, head_dim]``; returns
    ``[num_kv_heads, ceil(length / PAGE_SIZE)]`` in fp32. Shared by the Quest and PillarQuest drafts."""
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    num_pages = -(-length // PAGE_SIZE)
    padded = torch.nn.functional.pad(
        keys[:length].float(), (0, 0, 0, 0, 0, num_pages * PAGE_SIZE - length), value=float("nan")
    )
    pages = padded.reshape(num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    page_min = pages.nan_to_num(float("inf")).amin(dim=1)  # [P, Hkv, D]
    page_max = pages.nan_to_num(float("-inf")).amax(dim=1)
    grouped = query.float().reshape(num_kv_heads, -1, head_dim)  # [Hkv, G, D]
    return (
        torch.maximum(
            torch.einsum("hgd,phd->hgpd", grouped, page_min), torch.einsum("hgd,phd->hgpd", grouped, page_max)
        )
        .sum(dim=-1)
        .amax(dim=1)
    )  # [Hkv, P]
