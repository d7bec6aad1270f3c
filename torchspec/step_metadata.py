"""The attention metadata of every forward a step runs: the first (drafts, verifies, prompt chunks, plain
decodes), a draft chain's later ones, and the verify of the rounds drafted in the step. Built once per forward for
all layers from the plan and the device's slot table (positions, slots and lists gathered there, not on the host),
so host work grows with the batch, not with the context; graphs only copy what it builds into their buffers."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter

import numpy as np
import torch

from torchspec.draft_lists import DraftChoice, DraftForward, DraftKeys, RoundLists, build_lists, offsets
from torchspec.drafting import DraftPolicy
from torchspec.hf import verify_mass_buffer
from torchspec.kv_cache import KVPool
from torchspec.slot_table import SlotTable
from torchspec.step import AttentionMetadata, KVView, ScheduledRequest, StepPlan
from torchspec.transfer import to_device


class MetadataBuilder:
    """Builds a step's attention metadata (``build``, ``chain``) and what the runner needs with it: the requests'
    slot-table rows, the device's corrections to rounds launched ahead, a round's draft lists."""

    def __init__(
        self,
        table: SlotTable,
        pool: KVPool,
        policy: DraftPolicy | None,
        device: torch.device,
        windows: Sequence[int],
        num_kv_heads: dict[int, int],
        max_scored_queries: int,
        num_draft_slots: int,
    ) -> None:
        self.table = table
        self.pool = pool
        self.policy = policy
        self.device = device
        self.windows = windows  # the sliding windows of the model's layers
        self.num_kv_heads = num_kv_heads  # layer -> its KV heads
        # Layers that draft sparsely (and whose verify mass the policy learns from) -> their KV heads.
        self.sparse_heads = {layer: num_kv_heads[layer] for layer in (policy.sparse_layers if policy else [])}
        self.max_scored_queries = max_scored_queries  # a request's queries scored in one tile of the attention
        self.num_draft_slots = num_draft_slots
        self._choice_bounds = (0, 0)  # longest request and most recent positions a draft chose for (only grow)
        self._rows_of: tuple[Callable[[], StepPlan | None], np.ndarray] = (lambda: None, np.zeros(0, np.int64))

    def rows(self, plan: StepPlan) -> np.ndarray:
        """The slot-table rows of the plan's requests, in plan order (assigned on first use). Kept for the latest
        plan: its metadata and its advance both ask, a pass of Python over the batch each."""
        held, rows = self._rows_of
        if held() is not plan:  # (weakly held: a plan keeps its requests alive, and finished ones must go)
            items = plan.scheduled
            rows = np.fromiter((self.table.row(item.request) for item in items), np.int64, len(items))
            self._rows_of = (weakref.ref(plan), rows)
        return rows

    def build(
        self,
        plan: StepPlan,
        input_ids: torch.Tensor | None = None,
        shifts: torch.Tensor | None = None,
        lists: RoundLists | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the packed batch, built once for all layers.
        ``input_ids``: the packed tokens already on the device (a verify fed its drafts there), else the plan's.
        ``shifts``: the items' corrections (``shifts``) where some start is only known on the device.
        ``lists``: the draft requests' round lists (``round_lists``), of which this forward is the first.

        Host work grows with the batch and the step's query tokens, not with the context: slot lists are
        gathered from the device slot table (see slot_table.py)."""
        items, columns = plan.scheduled, plan.columns
        count = len(items)
        rows = self.rows(plan)
        starts, lengths = columns.first_position, columns.num_query_tokens
        cu_seqlens_q = offsets(lengths)
        total = int(cu_seqlens_q[-1])
        owner = np.repeat(np.arange(count), lengths)  # each query token's request
        positions = starts[owner] + np.arange(total) - cu_seqlens_q[owner]
        # One transfer for the step's per-token inputs: slot-table rows, offsets (and token ids). A position is
        # its request's computed count on the device plus its offset past it; the slot is the table's.
        per_token_inputs = [rows[owner], positions - columns.device_computed[owner]]
        if input_ids is None:  # a fed request's first token is a placeholder (0): only the others ask their items
            tokens = np.zeros(total, np.int64)
            for i in np.flatnonzero(~columns.fed | (columns.num_query_tokens > 1)).tolist():
                tokens[cu_seqlens_q[i] : cu_seqlens_q[i + 1]] = items[i].query_token_ids()
            per_token_inputs.append(tokens)
        per_token = to_device(np.stack(per_token_inputs), self.device)
        position_ids = self.table.computed[per_token[0]] + per_token[1]
        slots = self.table.slots[per_token[0], position_ids]
        ends = starts + lengths
        num_drafts = plan.num_drafts
        scored = self.scored_queries(plan.scheduled[num_drafts:])
        full = rows[num_drafts:], np.zeros(count - num_drafts, np.int64), ends[num_drafts:]
        # A sliding-window layer reads only the entries some query of this step can still see.
        windowed = {w: (rows, np.maximum(0, starts - w + 1), ends) for w in self.windows}
        full_shifts = None if shifts is None else shifts[num_drafts:]
        draft, draft_lists = {}, None
        if lists is not None:
            draft, draft_lists = self._layer_views(lists.forward(0, num_drafts)), lists.view.kv_indices
        full_view = self._view(*full, full_shifts)
        mass, mass_layers = None, {}
        if any(scored) and self.sparse_heads:
            mass, mass_layers = verify_mass_buffer(self.sparse_heads, len(scored), full_view.max_len, self.device)
        metadata = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=to_device(cu_seqlens_q, self.device),
            windowed={w: self._view(*ranges) for w, ranges in windowed.items()},
            full=full_view,
            num_drafts=num_drafts,
            draft=draft,
            draft_lists=draft_lists,
            draft_select=self._draft_selector(plan.scheduled[:num_drafts]),
            draft_choice=self.draft_choice(plan.scheduled[:num_drafts], position_ids[:num_drafts]),
            num_scored_queries=None if not any(scored) else to_device(scored, self.device),
            max_q_len=int(lengths.max()),
            max_scored_queries=max(scored, default=0),
            mass=mass,
            mass_layers=mass_layers,
        )
        ids = per_token[2] if input_ids is None else input_ids
        # Tokens whose input is the request's newest token, which the device holds.
        fed = np.flatnonzero(columns.fed)
        if fed.size:
            index = to_device(np.stack([cu_seqlens_q[fed], rows[fed]]), self.device)
            ids[index[0]] = self.table.last_tokens[index[1]]
        return ids[None], position_ids[None], metadata

    def shifts(self, plan: StepPlan) -> torch.Tensor | None:
        """Per item, how many positions before the host's assumption its request really starts, on the device:
        a round launched ahead (``bound``) assumes the round in flight accepts every draft. None when every
        item's start is known on the host (nothing to correct)."""
        if not any(map(attrgetter("bound"), plan.scheduled)):
            return None
        sent = to_device(np.stack([plan.columns.device_computed, self.rows(plan)]), self.device)
        return sent[0] - self.table.computed[sent[1]]

    def scored_queries(self, items: Sequence[ScheduledRequest]) -> list[int]:
        """Trailing queries whose attention mass the policy learns from: all queries of a verify, the last
        k + 1 of a final prefill chunk."""
        if self.policy is None or not self.policy.uses_verify_scores:
            return [0] * len(items)
        most = min(self.policy.config.k + 1, self.max_scored_queries)
        return [min(item.num_query_tokens, most) if item.samples and item.learns else 0 for item in items]

    def round_lists(
        self, drafts: Sequence[ScheduledRequest], rows: Sequence[int], shifts: torch.Tensor | None
    ) -> RoundLists | None:
        """The lists every draft forward of the step reads (see ``draft_lists``), the policy asked once per
        request, at its first draft; None without drafts or where the policy selects inside attention.
        ``shifts`` (device, per draft; see ``shifts``): a round launched ahead really starts that many positions
        earlier, so each forward's list ends that much earlier, and fixed positions past the first draft's true
        position are padding (K/V there is not this round's yet; the recent run covers what the later drafts
        see of it)."""
        if not drafts or self.policy.selects_in_attention:
            return None
        requests, count = [item.request for item in drafts], len(drafts)
        firsts = np.fromiter(map(attrgetter("first_position"), drafts), np.int64, count)
        chains = np.fromiter(map(attrgetter("chain"), drafts), np.int64, count)
        asked = (self.policy.draft_positions(r, p) for r, p in zip(requests, firsts.tolist(), strict=True))
        fixed, recent = zip(*asked, strict=True)
        recent_from = np.asarray(recent, dtype=np.int64)
        if shifts is not None:  # a round launched ahead reads at least every position since the committed ones
            computed = np.fromiter((r.num_computed_tokens for r in requests), np.int64, count)
            recent_from = np.minimum(recent_from, computed)
        shape = (len(self.policy.sparse_layers), self.policy.num_kv_heads)
        limit = None if shifts is None else to_device(firsts, self.device) - shifts
        view, indptr = build_lists(
            self.table, shape, np.asarray(rows, np.int64), firsts + chains - 1, fixed, recent_from, limit,
        )  # fmt: skip
        # Forward j's list ends at draft j: its chain's drafts after j left off (past its chain: empty).
        forward = np.arange(chains.max())[:, None]
        active = forward < chains
        ends = np.where(active, indptr[1:] - (chains - 1 - forward), indptr[:-1])
        if shifts is None:
            return RoundLists(view, to_device(ends, self.device))
        sent = to_device(np.stack([ends, active]), self.device)
        return RoundLists(view, sent[0] - sent[1] * shifts)

    def chain(
        self,
        drafts: Sequence[ScheduledRequest],
        counts: Sequence[int],
        layout: torch.Tensor,
        lists: RoundLists | None,
    ) -> Iterator[tuple[int, torch.Tensor, AttentionMetadata]]:
        """Request count, positions and metadata of each later forward of the step's draft chains: views into
        the round's lists and the layout built for all of them. Forward j's draft requests (the first
        ``counts[j - 1]``) are advanced along their chains only for what reads them per request: sliding windows,
        query-aware lists."""
        counting = torch.arange(len(drafts) + 1, device=self.device)
        no_verifies = KVView(counting[:1], counting[:0], 0)
        per_request = bool(self.windows) or self.policy.selects_in_attention
        start = 0
        for forward, count in enumerate(counts, start=1):
            end = start + count
            items = [item.advanced(forward) for item in drafts[:count]] if per_request else []
            draft, draft_lists = {}, None
            if lists is not None:
                draft, draft_lists = self._layer_views(lists.forward(forward, count)), lists.view.kv_indices
            windowed = {
                w: self._view(
                    [self.table.row(i.request) for i in items],
                    [max(0, i.first_position - w + 1) for i in items],
                    [i.first_position + 1 for i in items],
                )
                for w in self.windows
            }
            metadata = AttentionMetadata(
                slot_mapping=layout[1, start:end],
                cu_seqlens_q=counting[: count + 1],
                windowed=windowed,
                full=no_verifies,
                num_drafts=count,
                draft=draft,
                draft_lists=draft_lists,
                draft_select=self._draft_selector(items),
                draft_choice=self.draft_choice(items, layout[0, start:end]),
                max_q_len=1,
            )
            yield count, layout[0, None, start:end], metadata
            start = end

    def draft_choice(self, items: Sequence[ScheduledRequest], positions: torch.Tensor) -> DraftChoice | None:
        """For policies that choose on the device: what the draft requests ``items`` (at ``positions``, on the
        device) choose from. Its widths only grow over a generation (a graph captured once keeps serving)."""
        if not items or not self.policy.chooses_on_device:
            return None
        requests = [item.request for item in items]
        rows = [self.table.row(request) for request in requests]
        recent_start = [request.round.recent_start for request in requests]
        longest = max(request.max_total_tokens for request in requests) + self.num_draft_slots
        recent = max(item.first_position + 1 - start for item, start in zip(items, recent_start, strict=True))
        self._choice_bounds = (max(self._choice_bounds[0], longest), max(self._choice_bounds[1], recent))
        first = self.policy.first_choices(requests)
        widths = self.policy.widths(*self._choice_bounds, any(first))
        state = self.policy.prepare(self.table.slots.shape[0], widths, self.device)
        floor = [max(self.policy.config.min_budget, self.policy.step_share)] * len(items)
        sent = to_device([rows, recent_start, first, floor], self.device)
        return DraftChoice(
            table=self.table.slots,
            rows=sent[0],
            positions=positions,
            recent_start=sent[1],
            first=sent[2] != 0,
            floor=sent[3],
            widths=widths,
            choose=self._choose,
            state=state,
        )

    def _view(
        self,
        rows: Sequence[int] | np.ndarray,
        starts: Sequence[int] | np.ndarray,
        ends: Sequence[int] | np.ndarray,
        shrink: torch.Tensor | None = None,
    ) -> KVView:
        """Full lists of positions ``[starts[i], ends[i] - shrink[i])`` (see ``SlotTable.gather``)."""
        indptr, indices = self.table.gather(rows, starts, ends, shrink)
        lengths = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
        return KVView(indptr, indices, int(lengths.max(initial=0)))

    def _layer_views(self, view: KVView) -> dict[int, KVView]:
        """Each sparse layer's view of stacked draft lists ``[layers, Hkv, N]``."""
        per_layer = view.kv_indices.unbind(0)  # one op for all layers (a GPU pays ~10 us of host per op)
        width = view.kv_indices.shape[1]
        return {
            layer: KVView(
                view.kv_indptr,
                lists if self.num_kv_heads[layer] == width else lists[: self.num_kv_heads[layer]],
                view.max_len,
                view.kv_ends,
            )
            for layer, lists in zip(self.policy.sparse_layers, per_layer, strict=True)
        }

    def _draft_selector(self, items: Sequence[ScheduledRequest]):
        """For query-aware policies: each layer's lists of the draft requests, chosen by the policy from the
        layer's own draft queries."""
        if not items or not self.policy.selects_in_attention or self.policy.chooses_on_device:
            return None
        requests = [item.request for item in items]
        rows = np.fromiter((self.table.row(request) for request in requests), np.int64, len(items))
        firsts = np.fromiter(map(attrgetter("first_position"), items), np.int64, len(items))
        device_rows = to_device(rows, self.device)

        def select(layer: int, queries: torch.Tensor, k_cache: torch.Tensor, scale: float) -> KVView:
            keys = DraftKeys(self.table, k_cache, device_rows)
            forward = DraftForward(requests, firsts.tolist(), layer, queries, keys, scale)
            fixed, recent_from = self.policy.select_for_drafts(forward)
            return build_lists(self.table, (self.num_kv_heads[layer],), rows, firsts, fixed, recent_from)[0]

        return select

    def _choose(self, choice: DraftChoice, layer: int, queries: torch.Tensor, scale: float, shared: dict) -> KVView:
        codes, scales = self.pool.codes[layer], self.pool.scales[layer]
        return self.policy.choose_lists(choice, layer, queries, codes, scales, scale, shared)
