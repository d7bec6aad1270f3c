"""The one place that executes: a StepPlan becomes device metadata, one packed forward, and step results.

A step is launched (everything queued on the device, its results copied into pinned host memory behind an
event) and collected later (the host waits for that event alone), so the engine can launch the next step in
between and keep the GPU busy while the host reads and commits this one (delayed verification)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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
from torchspec.transfer import row_index, to_device


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
        feeds_next_step: bool = False,
    ) -> None:
        self.model = model
        # Dynamic shapes: the packed token count changes every step; attention is one opaque op per layer.
        self.forward = torch.compile(model, dynamic=True) if compile_model else model
        self.pool = pool
        self.ops = ops
        self.device = device
        self.policy = policy
        self.generator = generator
        # Keep each one-token step's token on the device, for the next step to be fed before the host reads it
        # (delayed verification); off, nothing is kept.
        self.feeds_next_step = feeds_next_step
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
        return to_device(values, self.device)

    def build_metadata(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the packed batch, built once for all layers.

        Host work grows with the batch and the step's query tokens, not with the context: slot lists are
        gathered from the device slot table (see slot_table.py)."""
        input_ids: list[int] = []
        fed_tokens: list[int] = []  # token indices whose input is the in-flight step's token, on the device
        fed_rows: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        token_rows: list[int] = []
        cu_seqlens_q = [0]
        rows, starts, ends = [], [], []
        for item in plan.scheduled:
            request, start = item.request, item.first_position
            end = start + item.num_query_tokens
            row = self.table.row(request)
            if item.fed:
                fed_tokens.append(len(input_ids))
                fed_rows.append(row)
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
        ids = self._tensor(input_ids)
        if fed_tokens:
            index = self._tensor([fed_tokens, fed_rows])
            ids[index[0]] = self.table.last_tokens[index[1]]
        return ids[None], self._tensor(positions)[None], metadata

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
        view, _ = self._policy_lists(items)  # lists [layers, Hkv, N]
        return self._layer_views(view), view.kv_indices

    def _policy_lists(self, items: Sequence[ScheduledRequest]) -> tuple[KVView, list[int]]:
        """The lists the policy fixes for each draft request's position (see ``_draft_lists``)."""
        chosen = [self.policy.draft_positions(item.request, item.first_position) for item in items]
        fixed, recent_from = zip(*chosen, strict=True)
        return self._draft_lists(items, fixed, recent_from)

    def _layer_views(self, view: KVView) -> dict[int, KVView]:
        """Each sparse layer's view of stacked draft lists ``[layers, Hkv, N]``."""
        per_layer = view.kv_indices.unbind(0)  # one op for all layers (a GPU pays ~10 us of host per op)
        width = view.kv_indices.shape[1]
        return {
            layer: KVView(
                view.kv_indptr,
                lists if self.num_kv_heads[layer] == width else lists[: self.num_kv_heads[layer]],
                view.max_len,
            )
            for layer, lists in zip(self.policy.sparse_layers, per_layer, strict=True)
        }

    def _draft_lists(
        self, items: Sequence[ScheduledRequest], fixed: Sequence[torch.Tensor], recent_from: Sequence[int] | None
    ) -> tuple[KVView, list[int]]:
        """Per-KV-head slot lists of draft requests (``[layers, Hkv, N]``, or ``[Hkv, N]`` for one layer's
        selection), built for all requests at once on the device, in a few launches whatever the batch:
        request j reads its ``fixed[j]`` positions (``[n]`` or ``[..., Hkv, n]``; -1 stays padding) and, when
        ``recent_from`` is given, every position from ``recent_from[j]`` to its draft position. Also returns
        the offsets (host), to slice the lists per forward of a draft chain."""
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
        return KVView(self._tensor(indptr), self.table.lookup(entry_rows, positions), max(lengths)), indptr

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
            return self._draft_lists(items, positions, None)[0]

        return select

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue one step: the forward, the policy's learning from verify attention, token selection; then
        the later forwards of draft chains, each fed the previous draft tokens on the device; then the copy of
        the step's tokens to the host. Nothing here waits for the GPU: a chain's forwards queue back to back,
        and the next step can be queued before this one is collected."""
        input_ids, position_ids, metadata = self.build_metadata(plan)
        logits, first_row = self._forward(plan, input_ids, position_ids, metadata)
        self._learn_from_verify(plan, metadata)
        picks = self._pick(plan, logits, first_row)
        drafts = plan.scheduled[: plan.num_drafts]
        chain = [picks.tokens[: len(drafts)]]  # draft requests own the first rows, one each
        for later, position_ids, metadata in self._chain_forwards(drafts):
            input_ids = chain[-1][None, : len(later.scheduled)]  # a prefix: drafts are sorted longest chain first
            logits, rows = self._forward(later, input_ids, position_ids, metadata)
            chain.append(self._pick(later, logits, rows).tokens)
        if self.feeds_next_step:
            self._keep_last_tokens(plan, first_row, picks)
        parts = [picks.tokens, *chain[1:]]
        if picks.accepted is not None:
            parts += [picks.accepted, picks.next_token]
        return LaunchedStep(
            plan=plan,
            first_row=first_row,
            sampled_rows=picks.sampled_rows,
            part_sizes=[part.shape[0] for part in parts],
            num_chain_forwards=len(chain) - 1,
            readback=_Readback(torch.cat(parts)),
            entropies=None if picks.entropies is None else _Readback(picks.entropies),
        )

    def _keep_last_tokens(self, plan: StepPlan, first_row: list[int], picks: _Picks) -> None:
        """Record on the device the token each request emits when it emits exactly one (a plain decode, a final
        prompt chunk): the next step may feed it before the host has read it (delayed verification)."""
        greedy_rows, greedy_table_rows, sampled, sampled_table_rows = [], [], [], []
        for item, row in zip(plan.scheduled, first_row, strict=True):
            one_token = item.phase is Phase.PREFILL or (item.phase is Phase.VERIFY and item.num_query_tokens == 1)
            if not (item.samples and one_token):
                continue
            if row in picks.sampled_rows:
                sampled.append(picks.sampled_rows[row])
                sampled_table_rows.append(self.table.row(item.request))
            else:
                greedy_rows.append(row)
                greedy_table_rows.append(self.table.row(item.request))
        if greedy_rows:
            index = self._tensor([greedy_rows, greedy_table_rows])
            self.table.last_tokens[index[1]] = picks.tokens[index[0]]
        if sampled:
            index = self._tensor([sampled, sampled_table_rows])
            self.table.last_tokens[index[1]] = picks.next_token[index[0]]

    def _chain_forwards(
        self, drafts: Sequence[ScheduledRequest]
    ) -> Iterator[tuple[StepPlan, torch.Tensor, AttentionMetadata]]:
        """Plans, positions and metadata of the later forwards of the step's draft chains (forward j holds the
        drafts whose chain is longer than j), built together: one slot-table write and one draft-list build
        for all of them, then views per forward (a forward of its own costs the host tens of tensor ops)."""
        longest = max((item.chain for item in drafts), default=1)
        if longest == 1:
            return
        plans = [StepPlan([item.advanced(j) for item in drafts if item.chain > j]) for j in range(1, longest)]
        flat = [item for later in plans for item in later.scheduled]
        positions = [item.first_position for item in flat]
        layout = self._tensor([positions, [item.request.slots[item.first_position] for item in flat]])
        self.table.write([self.table.row(item.request) for item in flat], positions, layout[1])
        lists, offsets = None, None
        if not self.policy.selects_in_attention:
            lists, offsets = self._policy_lists(flat)
        counting = torch.arange(len(drafts) + 1, device=self.device)
        no_verifies = KVView(counting[:1], counting[:0], 0)
        start = 0
        for later in plans:
            items, end = later.scheduled, start + len(later.scheduled)
            draft, draft_lists = {}, None
            if lists is not None:
                first, last = offsets[start], offsets[end]
                indptr = lists.kv_indptr[start : end + 1] - first
                max_len = max(b - a for a, b in itertools.pairwise(offsets[start : end + 1]))
                draft_lists = lists.kv_indices[..., first:last]
                draft = self._layer_views(KVView(indptr, draft_lists, max_len))
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
                cu_seqlens_q=counting[: len(items) + 1],
                windowed=windowed,
                full=no_verifies,
                num_drafts=len(items),
                draft=draft,
                draft_lists=draft_lists,
                draft_select=self._draft_selector(items),
                max_q_len=1,
            )
            yield later, layout[0, None, start:end], metadata
            start = end

    def _forward(
        self, plan: StepPlan, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, list[int]]:
        """The fp32 logits of every row that samples, and each request's first row among them."""
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
        return logits.float(), first_row

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

    def _pick(self, plan: StepPlan, logits: torch.Tensor, first_row: list[int]) -> _Picks:
        """Tokens from the logits rows of each request, on the device: draft samples, verified tokens (see
        speculative.py).

        Every random draw covers the whole forward at once, and nothing is read back here: per-request draws
        would cost a host round trip each, which for hundreds of requests costs more than the forward."""
        row_params, row_output_index = [], []
        for item in plan.scheduled:
            if not item.samples:
                continue
            request = item.request
            count = item.num_query_tokens if item.phase is Phase.VERIFY else 1
            # Output index of the token sampled after the first sampled row's position (from positions alone:
            # the host's token list may lag the step in flight).
            base = item.first_position + item.num_query_tokens - count + 1 - request.num_prompt_tokens
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
        probs = None
        if sampled_rows:
            sampled = logits[row_index(sampled_rows, self.device)]
            probs = warped_probs(sampled, [row_params[row] for row in sampled_rows])
        tokens = logits.argmax(dim=-1)
        drafts = [(item, row) for item, row in zip(plan.scheduled, first_row, strict=True) if item.phase is Phase.DRAFT]
        sampled_drafts = [(item, row) for item, row in drafts if row in prob_index]
        if sampled_drafts:
            draft_probs = probs[row_index([prob_index[row] for _, row in sampled_drafts], self.device)]
            draws = torch.multinomial(draft_probs, 1, generator=self.generator)
            tokens[row_index([row for _, row in sampled_drafts], self.device)] = draws[:, 0]
            table_rows = [self.table.row(item.request) for item, _ in sampled_drafts]
            # A draft's index in its round: its position past the newest accepted token.
            indices = [item.first_position - item.request.num_computed_tokens for item, _ in sampled_drafts]
            self.draft_probs.write(table_rows, indices, draft_probs)
        verifies = [
            (item, row)
            for item, row in zip(plan.scheduled, first_row, strict=True)
            if item.samples and item.phase is not Phase.DRAFT and row in prob_index
        ]
        accepted, next_token = self._accept_sampled(verifies, probs, prob_index) if verifies else (None, None)
        return _Picks(
            tokens=tokens,
            entropies=self._draft_entropies(logits, [row for _, row in drafts]),
            sampled_rows={row: i for i, (_, row) in enumerate(verifies)},
            accepted=accepted,
            next_token=next_token,
        )

    def collect(self, step: LaunchedStep) -> list[StepResult]:
        """Each request's results, from the one read-back of a launched step (waits for that step alone). The
        read-back holds each row's argmax (or draft draw), then the draft tokens of each later chain forward (a
        prefix of the step's draft requests each), then the sampled verifies' accepted counts and next tokens."""
        plan, first_row = step.plan, step.first_row
        argmax, *rest = _split(step.readback.tolist(), step.part_sizes)
        later, (accepted, next_token) = rest[: step.num_chain_forwards], rest[step.num_chain_forwards :] or ([], [])
        entropies = [] if step.entropies is None else step.entropies.tolist()
        results = []
        for index, (item, row) in enumerate(zip(plan.scheduled, first_row, strict=True)):
            if not item.samples:
                results.append(StepResult())
            elif item.phase is Phase.DRAFT:
                tokens = [argmax[row], *(forward[index] for forward in later[: item.chain - 1])]
                entropy = entropies[row] if entropies else None
                results.append(StepResult(draft_tokens=tokens, draft_entropy=entropy))
            else:
                drafts_made = item.request.round.tokens if item.phase is Phase.VERIFY else []
                if row in step.sampled_rows:
                    verify = step.sampled_rows[row]
                    tokens_out = [*drafts_made[: accepted[verify]], next_token[verify]]
                    results.append(StepResult(tokens=tokens_out, num_accepted=accepted[verify]))
                else:
                    num_accepted, tokens_out = accept_greedy(argmax[row : row + len(drafts_made) + 1], drafts_made)
                    results.append(StepResult(tokens=tokens_out, num_accepted=num_accepted))
        return results

    def _draft_entropies(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Predictive entropy of each draft row (``[rows]``), for policies that steer the round length by it."""
        if not rows or not self.policy.uses_draft_entropy:
            return None
        log_probs = logits[row_index(rows, self.device)].log_softmax(dim=-1)
        return -(log_probs.exp() * log_probs).nan_to_num().sum(dim=-1)

    def _accept_sampled(
        self, verifies: list[tuple[ScheduledRequest, int]], probs: torch.Tensor, prob_index: dict[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling of every sampled verify (and final prefill chunk) of the step in one batch:
        accepted drafts and next token of each, on the device. Sampled drafts' distributions come from the draft-probs
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
        return accept_sampled(target, drafts, draft_probs, num_drafts, self.generator)


class _Readback:
    """A device tensor on its way to the host: copied into pinned memory behind an event, so the host waits
    for the step that made it and not for whatever was queued after it."""

    def __init__(self, values: torch.Tensor) -> None:
        self.event = None
        if values.device.type == "cuda":
            self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = values

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()


@dataclass
class LaunchedStep:
    """A step queued on the device and not yet read back: what ``Runner.collect`` needs to make its results."""

    plan: StepPlan
    first_row: list[int]  # each request's first logits row
    sampled_rows: dict[int, int]  # first row of each sampled verify -> its index in accepted / next_token
    part_sizes: list[int]  # lengths of the read-back's parts (see ``Runner.collect``)
    num_chain_forwards: int  # later forwards of the step's draft chains
    readback: _Readback
    entropies: _Readback | None  # draft rows' entropies, for policies that steer by them


@dataclass
class _Picks:
    """A forward's token choices, still on the device (the step reads them back once, at its end)."""

    tokens: torch.Tensor  # [rows]: each row's argmax, or its draw for a sampled draft
    entropies: torch.Tensor | None  # [draft rows]: their entropy, for policies that steer by it
    sampled_rows: dict[int, int]  # first row of each sampled verify -> its index in accepted / next_token
    accepted: torch.Tensor | None  # [sampled verifies]: drafts kept
    next_token: torch.Tensor | None  # [sampled verifies]: the corrected or bonus token


def _split(values: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """Consecutive pieces of ``sizes`` items."""
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [values[start:end] for start, end in itertools.pairwise(bounds)]
