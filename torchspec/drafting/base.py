"""The draft-policy interface: what a sparse draft step attends to, or which tokens are proposed outright.

A policy is a small class registered by name; the engine asks it four things and knows nothing else:
whether a request can draft yet, the tokens it proposes without a forward (token proposers), the KV
positions a draft step attends to (sparse self-drafts), and what to remember from a verify step's exact
attention (policies that learn from it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import numpy as np
import torch

import attention
from torchspec.config import SpecConfig
from torchspec.draft_lists import ChoiceWidths, DraftChoice, DraftForward
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request
from torchspec.step import KVView


class DraftPolicy:
    """Base class; subclasses override what they need."""

    name: ClassVar[str]
    #: Drafts come from ``propose`` (no draft forward steps), e.g. n-gram lookup.
    proposes_tokens: ClassVar[bool] = False
    #: ``on_verify`` needs the verify step's attention mass per (full-attention layer, KV head, position).
    uses_verify_scores: ClassVar[bool] = False
    #: Draft steps choose their positions inside attention, from the layer's own query (``select_for_drafts``).
    selects_in_attention: ClassVar[bool] = False
    #: Query-aware policies that choose on the device alone (``choose_lists``): their draft forwards replay from CUDA
    #: graphs like any other.
    chooses_on_device: ClassVar[bool] = False
    #: Draft steps report the entropy of their distribution (``request.round.entropies``).
    uses_draft_entropy: ClassVar[bool] = False

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        self.config = config
        #: The op set the policy's device work runs on (``make_policy`` gives it the engine's).
        self.ops: ModuleType | SimpleNamespace = attention.reference
        #: Layers whose draft steps attend sparsely: the full-attention ones (sliding windows stay as they are).
        self.sparse_layers = [layer.layer_idx for layer in layers if layer.sliding_window is None]
        self.num_kv_heads = max((layer.num_kv_heads for layer in layers), default=1)
        #: Layers whose keys the KV pool also keeps as an int4 sketch (``KVPool.codes``), for drafts that score
        #: every cached key: none unless a policy asks.
        self.sketched_layers: frozenset[int] = frozenset()
        #: KV tokens every draft may attend to whatever its sparsity: the scheduler sets it each step to the
        #: running requests' share of the step's draft budget (``SpecConfig.draft_step_budget``).
        self.step_share = 0

    def budget(self, context_length: int, weight: float = 1.0) -> int:
        """KV tokens a draft step may attend to: ``max(min_budget, ceil(weight * max(sparsity * context,
        step_share)))``: a request's at its ``draft_weight`` (``request_budget``), a bound over a batch at 1."""
        share = max(self.config.sparsity * context_length, self.step_share)
        return max(self.config.min_budget, math.ceil(weight * share))

    def request_budget(self, request: Request, context_length: int) -> int:
        """The request's own draft budget at ``context_length``: ``budget`` at its ``draft_weight``."""
        return self.budget(context_length, request.draft_weight)

    def ready(self, request: Request) -> bool:
        """Whether the request can start a round with drafts (e.g. PillarAttn needs one verify's scores)."""
        return True

    def learns_from_round(self, request: Request) -> bool:
        """Whether the verify of the round the request starts now should hand its attention to the policy
        (``on_verify``): every one does unless a policy keeps what an earlier round taught it."""
        return True

    def learns_from_plain_step(self, request: Request) -> bool:
        """Whether a verify without drafts (a plain step, e.g. one the round length chose) should hand its
        attention to the policy (``on_verify``): every verify does unless a policy says its state is fresh
        enough, since learning can cost a plain step as much as its forward."""
        return True

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Token proposers: up to ``max_tokens`` draft tokens to verify next."""
        raise NotImplementedError

    def draft_positions(self, request: Request, position: int) -> tuple[torch.Tensor, int]:
        """What the round's drafts attend to, asked once per round at its first draft (``position``): positions
        fixed for the round (``[n]`` shared by all sparse layers and KV heads, or
        ``[len(sparse_layers), num_kv_heads, n]``, -1 = padding, kept on the device where the policy made them)
        and the first of the recent positions: each draft also attends to every position from it to its own.
        Split so the runner builds one list per request and round on the device, of which each draft reads a
        prefix (``torchspec.draft_lists``)."""
        raise NotImplementedError

    def first_choices(self, requests: Sequence[Request]) -> list[bool]:
        """Policies choosing on the device: which of a draft forward's requests make their round's first choice."""
        raise NotImplementedError

    def widths(self, bound: int, recent: int, any_first: bool) -> ChoiceWidths:
        """Policies choosing on the device: the widths of a step's lists for requests of at most ``bound``
        positions that read at most ``recent`` recent positions, some making their round's first choice or not."""
        raise NotImplementedError

    def prepare(self, table_rows: int, widths: ChoiceWidths, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Policies choosing on the device: room in their device state for ``table_rows`` slot-table rows; returns
        that state (a graph that reads it is captured again when it moves)."""
        raise NotImplementedError

    def choose_lists(
        self, choice: DraftChoice, layer: int, query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
        scale: float, shared: dict,
    ) -> KVView:  # fmt: skip
        """Policies choosing on the device: the lists (``[Hkv, n x width]`` with ``kv_ends``) that the draft
        queries ``[n, num_heads, head_dim]`` of ``choice`` read in sparse layer ``layer``, chosen in a fixed
        number of device operations (no host value: a CUDA graph replays them); ``shared``: what the forward's
        layers share (a policy keeps there what it computes once a forward)."""
        raise NotImplementedError

    def select_for_drafts(self, forward: DraftForward) -> tuple[list[torch.Tensor] | torch.Tensor, np.ndarray]:
        """Query-aware policies, for one draft forward's requests at once: each request's positions
        (``[num_kv_heads, n]``, -1 = padding; or all of them as one ``[requests, num_kv_heads, n]``) and the first
        of the recent run it also reads, up to its position.
        By default one ``select_positions`` a request (whose positions end with the recent ones: an empty run)."""
        requests, positions, layer, queries, keys, scale = forward
        chosen = [
            self.select_positions(request, position, layer, query, keys.up_to(j, position), scale)
            for j, (request, position, query) in enumerate(zip(requests, positions, queries, strict=True))
        ]
        return chosen, np.asarray(positions, dtype=np.int64) + 1

    def select_positions(
        self, request: Request, position: int, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Query-aware policies: positions (``[num_kv_heads, n]``, ending with the recent ones) that the draft
        query ``[num_heads, head_dim]`` at ``position`` attends to in sparse layer ``layer`` (its ``layer_idx``,
        for policies that keep per-layer state), given the layer's keys of every position
        ``[position + 1, num_kv_heads, head_dim]``."""
        raise NotImplementedError

    def num_older(self, request: Request, position: int) -> tuple[int, int]:
        """(older positions, how many of them fit the budget): positions before ``recent_start`` compete,
        the ones from it on (written since the last verify) are always attended to."""
        older = request.round.recent_start
        return older, min(older, max(0, self.request_budget(request, position + 1) - (position + 1 - older)))

    def with_recent(self, request: Request, position: int, selected: torch.Tensor) -> torch.Tensor:
        """``selected`` older positions (``[Hkv, n]``), sorted, followed by every position since the verify."""
        recent = torch.arange(request.round.recent_start, position + 1, device=selected.device)
        return torch.cat([selected.sort(dim=-1).values, recent.expand(selected.shape[0], -1)], dim=-1)

    def continue_drafting(self, request: Request) -> bool:
        """After each draft step: whether this round drafts another token (up to its length)."""
        return True

    def on_round_end(self, request: Request, num_accepted: int) -> None:
        """After a verify checked this round's drafts (``request.round`` still holds them)."""

    def on_verify(self, request: Request, mass: torch.Tensor | None, first_query_position: int) -> None:
        """Called after a step that ends with full attention over the request's newest tokens (a verify, or the
        last prefill chunk) and before its tokens are accepted. ``mass`` (only when ``uses_verify_scores``, and
        when some layer drafts sparsely) is ``[len(sparse_layers), num_kv_heads, context]`` on the model's
        device: the verify's attention mass per position (relative to the sink; see
        ``attention.reference.paged_attention``), computed in the verify's attention."""
        request.round.recent_start = first_query_position

    def on_verifies(
        self,
        requests: Sequence[Request],
        mass: torch.Tensor | None,
        rows: Sequence[int],
        contexts: Sequence[int],
        first_query_positions: Sequence[int],
    ) -> None:
        """``on_verify`` for all verifies of a step at once (what the runner calls): request j's mass is
        ``mass[..., rows[j], :contexts[j]]`` of one ``[layers, Hkv, verifies, width]`` tensor (each verify's
        positions in its own row, as the mass kernel writes them). One call per step lets a policy batch its
        device work (PillarAttn: one Top-K per step, not one per request)."""
        for request, row, context, first_query in zip(requests, rows, contexts, first_query_positions, strict=True):
            self.on_verify(request, None if mass is None else mass[..., row, :context], first_query)
