"""The one place that executes: a StepPlan becomes device metadata, one packed forward, and step results."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import ModuleType

import torch

from torchspec.cuda_graphs import StepGraphs
from torchspec.draft_probs import DraftProbsStore
from torchspec.drafting import DraftPolicy
from torchspec.hf import AttentionMetadata, KVView, PagedForwardContext, forward_context
from torchspec.kv_cache import KVPool, LayerSpec
from torchspec.sampling import suppress_stop_tokens, warped_probs
from torchspec.scheduler import Phase, ScheduledRequest, StepPlan, StepResult
from torchspec.slot_table import SlotTable
from torchspec.speculative import accept_greedy, accept_sampled


class Runner:
    """Runs the wrapped transformers model on packed batches over the paged KV pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        layers: Sequence[LayerSpec],
        ops: ModuleType,
        device: torch.device,
        policy: DraftPolicy | None = None,
        generator: torch.Generator | None = None,
        compile_model: bool = False,
        cuda_graphs: bool = False,
        max_batch_size: int = 256,
    ) -> None:
        self.model = model
        # Dynamic shapes: the packed token count changes every step; attention is one opaque op per layer.
        self.forward = torch.compile(model, dynamic=True) if compile_model else model
        self.pool = pool
        self.ops = ops
        self.device = device
        self.policy = policy
        self.generator = generator
        self.num_draft_slots = policy.config.k if policy is not None else 0
        self.windows = sorted({layer.sliding_window for layer in layers if layer.sliding_window is not None})
        self.num_kv_heads = {layer.layer_idx: layer.num_kv_heads for layer in layers}
        self.table = SlotTable(device)
        self.draft_probs = DraftProbsStore(self.num_draft_slots, device)
        self.graphs = None
        if cuda_graphs:
            sparse = {layer: self.num_kv_heads[layer] for layer in (policy.sparse_layers if policy else [])}
            scores = policy is not None and policy.uses_verify_scores
            verify_tokens = self.num_draft_slots + 1
            self.graphs = StepGraphs(self.forward, pool, ops, sparse, verify_tokens, scores, max_batch_size, device)

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def build_metadata(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the packed batch, built once for all layers.

        Host work grows with the batch and the step's query tokens, not with the context: slot lists are
        gathered from the device slot table (see slot_table.py)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        token_rows: list[int] = []
        cu_seqlens_q = [0]
        rows, starts, ends = [], [], []
        for item in plan.scheduled:
            request, start = item.request, item.first_position
            end = start + item.num_query_tokens
            row = self.table.row(request)
            input_ids.extend(item.query_token_ids())
            positions.extend(range(start, end))
            slot_mapping.extend(request.slots[start:end])
            token_rows.extend([row] * item.num_query_tokens)
            cu_seqlens_q.append(cu_seqlens_q[-1] + item.num_query_tokens)
            rows.append(row)
            starts.append(start)
            ends.append(end)
        slots = self._tensor(slot_mapping)
        self.table.write(token_rows, positions, slots)
        num_drafts = plan.num_drafts
        scored = self._scored_queries(plan.scheduled[num_drafts:])
        full = rows[num_drafts:], [0] * (len(rows) - num_drafts), ends[num_drafts:]
        # A sliding-window layer reads only the entries some query of this step can still see.
        windowed = {w: (rows, [max(0, start - w + 1) for start in starts], ends) for w in self.windows}
        draft, draft_lists = self._draft_views(plan.scheduled[:num_drafts])
        metadata = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=self._tensor(cu_seqlens_q),
            windowed={w: self._view(*ranges) for w, ranges in windowed.items()},
            full=self._view(*full),
            num_drafts=num_drafts,
            draft=draft,
            draft_lists=draft_lists,
            draft_select=self._draft_selector(plan.scheduled[:num_drafts]),
            num_scored_queries=None if not any(scored) else self._tensor(scored),
            max_q_len=max(item.num_query_tokens for item in plan.scheduled),
            max_scored_queries=max(scored, default=0),
        )
        return self._tensor(input_ids)[None], self._tensor(positions)[None], metadata

    def _view(self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> KVView:
        indptr, indices = self.table.gather(rows, starts, ends)
        lengths = [end - start for start, end in zip(starts, ends, strict=True)]
        return KVView(self._tensor(indptr), indices, max(lengths, default=0))

    def _scored_queries(self, items: Sequence[ScheduledRequest]) -> list[int]:
        """Trailing queries whose attention mass the policy learns from: all queries of a verify, the last
        k + 1 of a final prefill chunk."""
        if self.policy is None or not self.policy.uses_verify_scores:
            return [0] * len(items)
        k_plus_1 = self.policy.config.k + 1
        return [min(item.num_query_tokens, k_plus_1) if item.samples else 0 for item in items]

    def _draft_views(self, items: Sequence[ScheduledRequest]) -> tuple[dict[int, KVView], torch.Tensor | None]:
        """Per sparse layer, each draft request's per-KV-head slot lists (its policy's positions, as slots),
        and the stacked lists ``[layers, Hkv, N]`` the views slice."""
        if not items or self.policy.selects_in_attention:
            return {}, None
        chosen = [self.policy.draft_positions(item.request, item.first_position) for item in items]
        fixed, recent_from = zip(*chosen, strict=True)
        view = self._draft_lists(items, fixed, recent_from)  # lists [layers, Hkv, N]
        per_layer = view.kv_indices.unbind(0)  # one op for all layers (a GPU pays ~10 us of host per op)
        width = view.kv_indices.shape[1]
        views = {
            layer: KVView(
                view.kv_indptr,
                lists if self.num_kv_heads[layer] == width else lists[: self.num_kv_heads[layer]],
                view.max_len,
            )
            for layer, lists in zip(self.policy.sparse_layers, per_layer, strict=True)
        }
        return views, view.kv_indices

    def _draft_lists(
        self, items: Sequence[ScheduledRequest], fixed: Sequence[torch.Tensor], recent_from: Sequence[int] | None
    ) -> KVView:
        """Per-KV-head slot lists of draft requests (``[layers, Hkv, N]``, or ``[Hkv, N]`` for one layer's
        selection), built for all requests at once on the device, in a few launches whatever the batch:
        request j reads its ``fixed[j]`` positions (``[n]`` or ``[..., Hkv, n]``; -1 stays padding) and, when
        ``recent_from`` is given, every position from ``recent_from[j]`` to its draft position."""
        num_layers, num_heads = len(self.policy.sparse_layers), self.policy.num_kv_heads
        shape = (num_heads,) if fixed[0].dim() == 2 else (num_layers, num_heads)
        fixed = [f.expand(*shape, -1) if f.dim() == 1 else f for f in fixed]
        fixed_lengths = [f.shape[-1] for f in fixed]
        recent_lengths = [0] * len(items)
        if recent_from is not None:
            recent_lengths = [item.first_position + 1 - first for item, first in zip(items, recent_from, strict=True)]
        lengths = [a + b for a, b in zip(fixed_lengths, recent_lengths, strict=True)]
        indptr = list(itertools.accumulate(lengths, initial=0))
        fixed_starts = list(itertools.accumulate(fixed_lengths, initial=0))
        recent_starts = list(itertools.accumulate(recent_lengths, initial=0))
        rows = [self.table.row(item.request) for item in items]
        meta = self._tensor(
            [rows, lengths, indptr[:-1], fixed_lengths, fixed_starts[:-1], recent_lengths, recent_starts[:-1],
             list(recent_from or [0] * len(items))]
        )  # fmt: skip
        row, length, start, fixed_length, fixed_start, recent_length, recent_start, first_recent = meta
        positions = torch.empty(*shape, indptr[-1], dtype=torch.int64, device=self.device)
        owner = self._owners(fixed_length, fixed_starts[-1])
        local = torch.arange(fixed_starts[-1], device=self.device) - fixed_start[owner]
        positions[..., start[owner] + local] = torch.cat(fixed, dim=-1).to(self.device)  # one device each policy
        owner = self._owners(recent_length, recent_starts[-1])
        local = torch.arange(recent_starts[-1], device=self.device) - recent_start[owner]
        positions[..., start[owner] + fixed_length[owner] + local] = first_recent[owner] + local
        entry_rows = torch.repeat_interleave(row, length, output_size=indptr[-1])
        return KVView(self._tensor(indptr), self.table.lookup(entry_rows, positions), max(lengths))

    def _owners(self, lengths: torch.Tensor, total: int) -> torch.Tensor:
        """For each of ``total`` concatenated entries, the index of the request it belongs to."""
        return torch.repeat_interleave(torch.arange(len(lengths), device=self.device), lengths, output_size=total)

    def _draft_selector(self, items: Sequence[ScheduledRequest]):
        """For query-aware policies: pick each draft request's lists from the layer's own draft queries."""
        if not items or not self.policy.selects_in_attention:
            return None

        def select(layer: int, queries: torch.Tensor, k_cache: torch.Tensor, scale: float) -> KVView:
            positions = []
            for item, query in zip(items, queries, strict=True):
                slots = self.table.slots[self.table.row(item.request), : item.first_position + 1]
                chosen = self.policy.select_positions(
                    item.request, item.first_position, layer, query, k_cache[slots], scale
                )
                positions.append(chosen.to(self.device))
            return self._draft_lists(items, positions, None)

        return select

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[StepResult]:
        """Execute one step: the forward, the policy's learning from verify attention, token selection."""
        input_ids, position_ids, metadata = self.build_metadata(plan)
        rows, first_row, end = [], [], 0
        for item in plan.scheduled:
            first_row.append(len(rows))
            end += item.num_query_tokens
            if item.samples:
                count = item.num_query_tokens if item.phase is Phase.VERIFY else 1
                rows.extend(range(end - count, end))
        prefill = any(item.phase is Phase.PREFILL for item in plan.scheduled)
        if self.graphs is not None and self.graphs.eligible(metadata, prefill):
            max_list_len = max(item.request.max_total_tokens for item in plan.scheduled) + self.num_draft_slots
            logits = self.graphs.logits(input_ids, position_ids, metadata, rows, max_list_len)
        else:
            context = PagedForwardContext(metadata=metadata, pool=self.pool, ops=self.ops)
            with forward_context(context):
                output = self.forward(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=self._tensor(rows)
                )
            logits = output.logits[0]
        self._learn_from_verify(plan, metadata)
        return self._select(plan, logits.float(), first_row)

    def _learn_from_verify(self, plan: StepPlan, metadata: AttentionMetadata) -> None:
        """Hand each verify's attention mass ``[layers, Hkv, context]`` (a view of one stacked tensor, on the
        device) to the policy; list offsets and scored counts come from the plan, not from the device."""
        if self.policy is None:
            return
        full_items = plan.scheduled[metadata.num_drafts :]
        scored = self._scored_queries(full_items)
        stacked = None
        if any(scored) and self.policy.sparse_layers:
            stacked = torch.stack([metadata.mass[layer] for layer in self.policy.sparse_layers])
        requests, spans, first_queries = [], [], []
        start = 0
        for item, count in zip(full_items, scored, strict=True):
            end = start + item.first_position + item.num_query_tokens
            if item.samples:
                requests.append(item.request)
                spans.append((start, end))
                first_queries.append(item.first_position + item.num_query_tokens - (count or item.num_query_tokens))
            start = end
        if requests:
            self.policy.on_verifies(requests, stacked, spans, first_queries)

    def _select(self, plan: StepPlan, logits: torch.Tensor, first_row: list[int]) -> list[StepResult]:
        """Tokens from the logits rows of each request: draft samples, verified tokens (see speculative.py).

        Every random draw and every device-to-host transfer covers the whole step at once: per-request draws
        would cost a host round trip each, which for hundreds of requests costs more than the forward."""
        row_params, row_output_index = [], []
        for item in plan.scheduled:
            if not item.samples:
                continue
            request = item.request
            count = item.num_query_tokens if item.phase is Phase.VERIFY else 1
            base = request.num_output_tokens + (len(request.round.tokens) if item.phase is Phase.DRAFT else 0)
            row_params.extend([request.params] * count)
            row_output_index.extend(range(base, base + count))
        below_minimum = [
            row
            for row, (p, index) in enumerate(zip(row_params, row_output_index, strict=True))
            if index < p.min_new_tokens
        ]
        suppress_stop_tokens(logits, below_minimum, [row_params[row].stop_token_ids for row in below_minimum])
        sampled_rows = [row for row, params in enumerate(row_params) if not params.greedy]
        prob_index = {row: i for i, row in enumerate(sampled_rows)}
        probs = warped_probs(logits[sampled_rows], [row_params[row] for row in sampled_rows]) if sampled_rows else None
        tokens = logits.argmax(dim=-1)
        drafts = [(item, row) for item, row in zip(plan.scheduled, first_row, strict=True) if item.phase is Phase.DRAFT]
        sampled_drafts = [(item, row) for item, row in drafts if row in prob_index]
        if sampled_drafts:
            draft_probs = probs[[prob_index[row] for _, row in sampled_drafts]]
            draws = torch.multinomial(draft_probs, 1, generator=self.generator)
            tokens[[row for _, row in sampled_drafts]] = draws[:, 0]
            table_rows = [self.table.row(item.request) for item, _ in sampled_drafts]
            self.draft_probs.write(
                table_rows, [len(item.request.round.tokens) for item, _ in sampled_drafts], draft_probs
            )
        entropies = self._draft_entropies(logits, [row for _, row in drafts])
        verifies = [
            (item, row)
            for item, row in zip(plan.scheduled, first_row, strict=True)
            if item.samples and item.phase is not Phase.DRAFT and row in prob_index
        ]
        sampled = self._accept_sampled(verifies, probs, prob_index) if verifies else {}
        argmax = tokens.tolist()
        results = []
        for item, row in zip(plan.scheduled, first_row, strict=True):
            if not item.samples:
                results.append(StepResult())
            elif item.phase is Phase.DRAFT:
                results.append(StepResult(draft_token=argmax[row], draft_entropy=entropies.get(row)))
            else:
                drafts_made = item.request.round.tokens if item.phase is Phase.VERIFY else []
                if row in sampled:
                    accepted, next_token = sampled[row]
                    tokens_out = [*drafts_made[:accepted], next_token]
                else:
                    accepted, tokens_out = accept_greedy(argmax[row : row + len(drafts_made) + 1], drafts_made)
                results.append(StepResult(tokens=tokens_out, num_accepted=accepted))
        return results

    def _draft_entropies(self, logits: torch.Tensor, rows: list[int]) -> dict[int, float]:
        """Predictive entropy of each draft row, for policies that steer the round length by it."""
        if not rows or not self.policy.uses_draft_entropy:
            return {}
        log_probs = logits[rows].log_softmax(dim=-1)
        entropy = -(log_probs.exp() * log_probs).nan_to_num().sum(dim=-1)
        return dict(zip(rows, entropy.tolist(), strict=True))

    def _accept_sampled(
        self, verifies: list[tuple[ScheduledRequest, int]], probs: torch.Tensor, prob_index: dict[int, int]
    ) -> dict[int, tuple[int, int]]:
        """Rejection sampling of every sampled verify (and final prefill chunk) of the step in one batch:
        ``{first row: (accepted drafts, next token)}``. Sampled drafts' distributions come from the draft-probs
        store (written by their draft steps); proposed drafts (n-gram) count as point masses."""
        rounds = [item.request.round.tokens if item.phase is Phase.VERIFY else [] for item, _ in verifies]
        n = max(len(tokens) for tokens in rounds)
        # A verify's rows are consecutive, all sampled (one request's parameters): so are their probs rows.
        first = self._tensor([prob_index[row] for _, row in verifies])
        num_drafts = self._tensor([len(tokens) for tokens in rounds])
        steps = torch.arange(n + 1, device=self.device)
        target = probs[first[:, None] + torch.minimum(steps, num_drafts[:, None])]  # padding: the last row again
        drafts = self._tensor([[*tokens, *[0] * (n - len(tokens))] for tokens in rounds]).view(len(rounds), n)
        if self.policy is not None and self.policy.proposes_tokens:  # proposed drafts: point masses
            draft_probs = torch.zeros(len(rounds), n, probs.shape[-1], dtype=probs.dtype, device=probs.device)
            draft_probs.scatter_(2, drafts[..., None], (steps[:n] < num_drafts[:, None]).to(probs.dtype)[..., None])
        elif n:
            rows = [self.table.row(item.request) for item, _ in verifies]
            draft_probs = self.draft_probs.read(rows, num_drafts, n, probs.shape[-1])
        else:
            draft_probs = probs.new_zeros(len(rounds), 0, probs.shape[-1])
        accepted, next_token = accept_sampled(target, drafts, draft_probs, num_drafts, self.generator)
        pairs = zip(accepted.tolist(), next_token.tolist(), strict=True)
        return {row: pair for (_, row), pair in zip(verifies, pairs, strict=True)}
