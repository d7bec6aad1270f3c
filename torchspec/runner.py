"""The one place that executes: a StepPlan becomes device metadata, one packed forward, and step results.

A step is launched (everything queued on the device, its results copied into pinned host memory behind an
event) and collected later (the host waits for that event alone), so the engine can launch the next step in
between and keep the GPU busy while the host reads and commits this one (delayed verification)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from types import ModuleType

import numpy as np
import torch

from attention.reference import MAX_SCORED_ROWS
from torchspec.chain_graphs import ChainGraphs, ChainInputs
from torchspec.cuda_graphs import StepGraphs
from torchspec.draft_lists import RoundLists
from torchspec.draft_probs import DraftProbsStore
from torchspec.draft_sampling import DraftSampling
from torchspec.drafting import DraftPolicy
from torchspec.hf import PagedForwardContext, forward_context
from torchspec.kv_cache import KVPool, LayerSpec
from torchspec.kv_offload import HostKVStore
from torchspec.penalty import TokenPresence
from torchspec.plain_batch import PlainBatch
from torchspec.request import Request
from torchspec.slot_table import SlotTable
from torchspec.step import AttentionMetadata, Phase, ScheduledRequest, StepPlan, StepResult
from torchspec.step_metadata import MetadataBuilder
from torchspec.token_picks import KeptRows, Picks, TokenPicker
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
        host_capacity_tokens: int = 0,
    ) -> None:
        self.model = model
        # The KV host tier (``offload``), holding at most ``host_capacity_tokens`` rows (0: none).
        self.host = HostKVStore(pool, host_capacity_tokens) if host_capacity_tokens else None
        # Dynamic shapes: the packed token count changes every step; attention is one opaque op per layer.
        self.forward = torch.compile(model, dynamic=True) if compile_model else model
        self.pool = pool
        self.ops = ops
        self.device = device
        self.policy = policy
        self.generator = generator
        self.num_draft_slots = policy.config.k if policy is not None else 0
        self.list_bound = 0  # the most tokens a request of the current generation may hold (graph list bounds)
        self.windows = sorted({layer.sliding_window for layer in layers if layer.sliding_window is not None})
        # The attention scores a request's queries in one tile of (query, GQA head) rows.
        largest_group = max(layer.num_heads // layer.num_kv_heads for layer in layers)
        if policy is not None and policy.uses_verify_scores and largest_group > MAX_SCORED_ROWS:
            raise ValueError(
                f"draft={policy.name!r} learns from the verify's attention, which is scored for GQA groups of at most "
                f"{MAX_SCORED_ROWS} query heads; this model has {largest_group}: use draft='streaming'"
            )
        max_scored_queries = max(1, MAX_SCORED_ROWS // largest_group)
        self.table = SlotTable(device)
        num_kv_heads = {layer.layer_idx: layer.num_kv_heads for layer in layers}
        self.builder = MetadataBuilder(
            self.table, pool, policy, device, self.windows, num_kv_heads, max_scored_queries, self.num_draft_slots
        )
        # The batch of plain steps (``_plain_batch``), with the ids and slot-table rows of its requests.
        self._plain: tuple[list[int] | None, np.ndarray | None, PlainBatch | None] = (None, None, None)
        self.draft_probs = DraftProbsStore(self.num_draft_slots, device)
        self.presence = TokenPresence(device)  # the tokens of requests with a repetition penalty
        self.picker = TokenPicker(self.table, policy, self.draft_probs, self.presence, ops, device, generator)
        self.graphs = None
        if cuda_graphs:
            verify_tokens = self.num_draft_slots + 1
            scored = min(verify_tokens, max_scored_queries) if policy and policy.uses_verify_scores else 0
            self.graphs = StepGraphs(
                self.forward,
                pool,
                ops,
                self.builder.sparse_heads,
                verify_tokens,
                scored,
                max_batch_size,
                device,
                generator,
            )
        # The later forwards of draft chains as graphs per bucket, one per forward: policies whose lists the runner
        # builds, models without sliding windows, and (when capturing) the default generator, which graphs replay.
        self.max_batch_size = max_batch_size
        self.chain_graphs = None
        if (
            cuda_graphs
            and policy is not None
            and policy.sparse_layers
            and (not policy.selects_in_attention or policy.chooses_on_device)
            and not self.windows
            and (generator is None or device.type != "cuda")
        ):
            self.chain_graphs = ChainGraphs(self.graphs, self.num_draft_slots, generator)

    @property
    def num_captures(self) -> int:
        """CUDA graphs captured so far (step and chain graphs share one log)."""
        return self.graphs.captures.count if self.graphs is not None else 0

    @torch.inference_mode()
    def move_kv(self, plan: StepPlan) -> None:
        """The plan's KV moves, queued before any step that reuses their slots: requests leaving the pool copy
        their K/V to the host and give their slot-table rows back; those coming back copy theirs into their
        new slots and get a row (with their newest token, which a decoding step reads from it); requests given
        more slots get them in their rows; samples of a prompt copy its K/V from another's slots into theirs;
        requests that ended while the plan was made give their rows back."""
        for request, slots in plan.offloads:
            self.host.offload(id(request), slots)
            self.release(request)
        for request in plan.restores:
            self.host.restore(id(request), request.slots[: request.num_computed_tokens])
            row = self.table.row(request)
            if request.decoding:
                self.table.last_tokens[row] = request.token_ids[-1]
        if plan.forks:  # after the restores: a source may have just come back
            # A sample has no slot-table row yet (one that leaves the pool while it waits gives its source up): the
            # row it gets at its first step counts the copied positions computed.
            sources = [slot for _, slots in plan.forks for slot in slots]
            self.pool.copy(sources, [slot for request, slots in plan.forks for slot in request.slots[: len(slots)]])
        self.table.extend(plan.grown)
        for request in plan.stopped:
            self.release(request)

    def release(self, request: Request) -> None:
        """Give a request's slot-table row back; the row's token set forgets it (a finished request is not kept
        alive by it; one coming back from the host tier writes its set again from its tokens)."""
        if request.table_row is not None:
            self.presence.forget(request.table_row)
        self.table.release(request)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue one step: the forward, the policy's learning from verify attention, token selection; then
        the later forwards of draft chains, each fed the previous draft tokens on the device; then the verify
        forward of the rounds drafted in this step, fed their drafts on the device too; then the copy of the
        step's tokens to the host. A plain step of a ``PlainBatch`` is one graph replay instead (its inputs,
        selection and advance on the device) where graphs run. Nothing here waits for the GPU: a round's forwards
        queue back to back, and the next step can be queued before this one is collected."""
        drafts = plan.scheduled[: plan.num_drafts]
        shifts = self.builder.shifts(plan)
        draft_shifts = None if shifts is None else shifts[: len(drafts)]
        draft_rows = self.builder.rows(plan)[: len(drafts)].tolist()  # their slot-table and store rows
        lists = self.builder.round_lists(drafts, draft_rows, draft_shifts)
        plain, sampling = self._plain_batch(plan), None
        if plain is not None and self.graphs is not None and not self.windows:  # the whole step in its graph
            contexts = plan.columns.device_computed + 1
            tokens = self.graphs.plain_tokens(plain, contexts, self._max_list_len(plan.scheduled))
            first_row, picks = list(range(len(contexts))), Picks.plain(tokens)
        else:
            input_ids, position_ids, metadata = self.builder.build(plan, shifts=shifts, lists=lists)
            logits, first_row = self._forward(plan, input_ids, position_ids, metadata)
            self._learn_from_verify(plan, metadata)
            sampling = self._draft_sampling(drafts, draft_rows, logits.shape[-1], draft_shifts)
            if plain is not None:  # a plain step without a graph: the same selection and advance, eagerly
                plain.draw_seed(self.generator)
                picks = Picks.plain(plain.tokens(logits))
            else:
                picks = self.picker.pick(plan, logits, first_row, sampling=sampling, shifts=shifts)
                self._advance(plan, picks)
        first_drafts = picks.tokens[: len(drafts)]  # draft requests own the first rows, one each
        later, chain_span = self._later_drafts(drafts, draft_rows, first_drafts, sampling, lists)
        parts = picks.parts() if later is None else [*picks.parts(), later.flatten()]
        verify = self._verify_rounds(drafts, first_drafts, later, draft_shifts)
        if verify is not None:
            parts += verify[1].parts()[1:]  # its rows' tokens are verified, not drawn: not read back
        return LaunchedStep(
            plan=plan,
            first=_Pass(first_row, picks.emitting_rows, picks.kept),
            verify=None if verify is None else _Pass(verify[0], verify[1].emitting_rows, verify[1].kept),
            part_sizes=[part.shape[0] for part in parts],
            num_chain_forwards=0 if later is None else later.shape[0],
            readback=_Readback(torch.cat(parts)),
            entropies=None if picks.entropies is None else _Readback(picks.entropies),
            chain_span=chain_span,
        )

    def _verify_rounds(
        self,
        drafts: Sequence[ScheduledRequest],
        first_drafts: torch.Tensor,
        later: torch.Tensor | None,
        shifts: torch.Tensor | None,
    ) -> tuple[list[int], Picks] | None:
        """The verify forward of the rounds drafted in this step (draft chains that ``verifies``): each request's
        newest token and its drafts, the drafts fed from the chain's tokens on the device. Returns each
        request's first logits row and the picks."""
        rounds = [(index, item) for index, item in enumerate(drafts) if item.verifies]
        if not rounds:
            return None
        # The drafts as a matrix [draft requests, longest chain]; past a request's chain, padding (never read).
        drafted = first_drafts[:, None] if later is None else torch.cat([first_drafts[:, None], later.t()], dim=1)
        plan = StepPlan(
            [
                ScheduledRequest(
                    item.request, Phase.VERIFY, 1 + item.chain, ahead=item.ahead, learns=item.learns, bound=item.bound
                )
                for _, item in rounds
            ]
        )
        # Flat queries, request after request: the newest token, then the drafts (column j of its drafted row).
        chains = np.array([item.chain for _, item in rounds])
        newest_at = np.cumsum(1 + chains) - 1 - chains
        owner = np.repeat(np.arange(len(rounds)), chains)
        column = np.arange(owner.size) - np.repeat(np.cumsum(chains) - chains, chains)
        # Zeros where the newest tokens go (the builder feeds them from the device) and the drafts, put below.
        input_ids = torch.zeros(int(newest_at[-1] + chains[-1] + 1), dtype=torch.int64, device=self.device)
        rows = np.array([index for index, _ in rounds])
        index = to_device(np.stack([newest_at[owner] + 1 + column, rows[owner], column]), self.device)
        input_ids[index[0]] = drafted[index[1], index[2]]
        plan_rows = row_index(rows.tolist(), self.device)
        shifts = None if shifts is None else shifts[plan_rows]
        input_ids, position_ids, metadata = self.builder.build(plan, input_ids, shifts)
        logits, first_row = self._forward(plan, input_ids, position_ids, metadata)
        self._learn_from_verify(plan, metadata)
        picks = self.picker.pick(plan, logits, first_row, drafted[plan_rows], shifts=shifts)
        self._advance(plan, picks)
        return first_row, picks

    def _advance(self, plan: StepPlan, picks: Picks) -> None:
        """Move the device's state of the forward's requests past it (``SlotTable.computed``, ``last_tokens``): a
        prompt chunk's tokens and a verify's newest token and accepted drafts are computed, and a request holds
        as its newest token the last one it emitted (or the prompt's next, past a chunk short of the end). Draft
        steps change nothing: their K/V stays past the computed count until a verify accepts it. Queued on the
        device, so the next step reads what this one leaves, before the host has read anything back."""
        columns = plan.columns
        indices = np.flatnonzero(~columns.is_draft)  # plan indices of the forward's other requests
        if not indices.size:
            return
        # Computed past a forward's queries: its prompt tokens, or a verify's newest token, plus accepted drafts.
        gains = columns.num_query_tokens[indices] - columns.checked_drafts[indices]
        sent = to_device(np.concatenate([self.builder.rows(plan)[indices], gains]), self.device)
        rows, gains = sent.view(2, indices.size)
        if picks.emitting:  # their plan indices (ascending, as ``indices``), in picks order
            at = row_index(np.searchsorted(indices, picks.emitting).tolist(), self.device)
            gains[at] += picks.accepted
            self.table.last_tokens[rows[at]] = picks.next_token
            self._record_tokens(plan, picks, rows[at])
        self.table.computed[rows] += gains
        # A prompt chunk short of the end leaves the prompt's next token as the newest (a step may feed it as a
        # decode when it is the prompt's last).
        chunks = [plan.scheduled[i] for i in indices[columns.sampled_rows[indices] == 0].tolist()]
        if chunks:
            newest = [item.request.token_ids[item.first_position + item.num_query_tokens] for item in chunks]
            index = to_device([[self.table.row(item.request) for item in chunks], newest], self.device)
            self.table.last_tokens[index[0]] = index[1]

    def _record_tokens(self, plan: StepPlan, picks: Picks, rows: torch.Tensor) -> None:
        """Add what the forward's penalising requests emit to their tokens on the device (``rows``: the
        slot-table rows of the emitting requests, in picks order)."""
        penalising = [j for j, i in enumerate(picks.emitting) if plan.scheduled[i].request.params.penalises]
        if penalising:
            at = row_index(penalising, self.device)
            self.presence.record(rows[at], picks.drafts[at], picks.accepted[at], picks.next_token[at])

    def _draft_sampling(
        self,
        drafts: Sequence[ScheduledRequest],
        rows: Sequence[int],
        vocab_size: int,
        shifts: torch.Tensor | None,
    ) -> DraftSampling | None:
        """The sampling columns of the step's draft chains (None without drafts; ``rows``: their slot-table
        rows; ``shifts``: see ``MetadataBuilder.shifts``), every forward of a chain selecting from them; and room in the
        draft-probs store for their rows, the chain graph's spare row included."""
        if not drafts:
            return None
        first_positions = [item.first_position for item in drafts]
        columns = [item.first_position - item.device_computed for item in drafts]  # drafts made before
        requests = [item.request for item in drafts]
        presence = None
        if any(request.params.penalises for request in requests):  # with the drafts made before (on the host)
            earlier = [request.round.tokens[:column] for request, column in zip(requests, columns, strict=True)]
            presence = self.presence.round_sets(requests, rows, vocab_size, earlier)
        sampling = DraftSampling.of(
            requests, first_positions, rows, columns, self.device, self.ops.top_k_positions, presence
        )
        if shifts is not None:  # a round that starts earlier draws earlier outputs: stop tokens stay forbidden longer
            sampling.suppress_until = sampling.suppress_until + shifts
        spare = self.max_batch_size if self.chain_graphs is not None else 0
        # Before any forward writes: never regrown within the step (greedy rounds keep no distribution).
        self.draft_probs.reserve(max(*rows, spare) + 1, vocab_size, 0 if sampling.all_greedy else sampling.support)
        return sampling

    def _later_drafts(
        self,
        drafts: Sequence[ScheduledRequest],
        draft_rows: Sequence[int],
        first: torch.Tensor,
        sampling: DraftSampling | None,
        lists: RoundLists | None,
    ) -> tuple[torch.Tensor | None, _Span | None]:
        """The tokens of the later forwards of the step's draft chains, ``[forwards, draft requests]`` (row j - 1:
        forward j, which holds the drafts whose chain is longer than j: a prefix, as drafts are sorted longest
        chain first; padding past it), each forward fed the previous one's tokens on the device. Their slots are
        looked up together and they read the round's ``lists``; then the chain graphs replay them where they can,
        else one forward per draft runs with its own selection. Also the span of those forwards alone, back to
        back: what one more draft costs a round (the round length's measure). None, None without later forwards."""
        longest = max((item.chain for item in drafts), default=1)
        if longest == 1:
            return None, None
        # Forward j (1 .. longest - 1) holds the drafts whose chain is longer than j: a prefix of them. Its
        # entries, forward after forward: each such draft at its first position + j.
        chains = np.fromiter(map(attrgetter("chain"), drafts), np.int64, len(drafts))
        counts = (chains[None, :] > np.arange(1, longest)[:, None]).sum(axis=1).tolist()
        owner = np.concatenate([np.arange(count) for count in counts])
        first_positions = np.fromiter(map(attrgetter("first_position"), drafts), np.int64, len(drafts))
        entry_positions = first_positions[owner] + np.repeat(np.arange(1, longest), counts)
        entry_rows = np.array(draft_rows)[owner]
        computed = np.fromiter(map(attrgetter("device_computed"), drafts), np.int64, len(drafts))[owner]
        sent = to_device(np.stack([entry_positions - computed, entry_rows]), self.device)  # offsets past computed, rows
        entry_positions_t = self.table.computed[sent[1]] + sent[0]
        layout = torch.stack([entry_positions_t, self.table.slots[sent[1], entry_positions_t]])  # positions, slots
        # Sampled once per forward from the round's columns: the chain graph's ops, or the same ops per forward.
        if self._chain_graph_runs(draft_rows):
            inputs = self._chain_inputs(drafts, counts, first, layout, lists, sampling)
            span = _Span(self.device)
            tokens = self.chain_graphs.tokens(inputs, self.draft_probs.kept, spare_row=self.max_batch_size)
            span.stop()
            return tokens, span
        max_list_len = self._max_list_len(drafts)
        tokens = first.new_zeros(longest - 1, len(drafts))
        fed = first  # each forward's input tokens: the previous forward's draws
        metadata = self.builder.chain(drafts, counts, layout, lists)
        span = _Span(self.device)
        for forward, (count, position_ids, forward_metadata) in enumerate(metadata, start=1):
            logits = self._logits(
                forward_metadata, fed[None, :count], position_ids, list(range(count)), max_list_len=max_list_len
            )
            fed = sampling.prefix(count).select(logits, forward, self.draft_probs.kept, self.generator)
            tokens[forward - 1, :count] = fed
        span.stop()
        return tokens, span

    def _chain_graph_runs(self, rows: Sequence[int]) -> bool:
        """Whether this step's chains replay from the chain graphs: every draft request in a slot-table row
        (``rows``) the fixed draft-probs store holds."""
        return self.chain_graphs is not None and max(rows) < self.max_batch_size

    def _chain_inputs(
        self,
        drafts: Sequence[ScheduledRequest],
        counts: Sequence[int],
        first: torch.Tensor,
        layout: torch.Tensor,
        lists: RoundLists | None,
        sampling: DraftSampling,
    ) -> ChainInputs:
        """The round's chain inputs (see ``ChainInputs``) for its draft requests ``drafts``; the positions and slots
        are the chain ``layout`` (``[2, forwards' requests]``, already on the device) spread into one row per later
        forward. Without ``lists`` the policy chooses on the device, for positions up to each chain's last."""
        count, later = first.shape[0], len(counts)
        # Each layout entry's place in the [later, count] grid.
        targets = to_device([j * count + i for j, active in enumerate(counts) for i in range(active)], self.device)
        grid = layout.new_zeros(2, later * count)  # padding: position 0, the scratch slot
        grid[1] = self.pool.scratch_slot
        grid[:, targets] = layout
        choice = None
        if lists is None:
            last = [item.advanced(item.chain - 1) for item in drafts]
            choice = self.builder.draft_choice(last, grid[0, :count])
        return ChainInputs(
            first_tokens=first,
            positions=grid[0].view(later, count),
            slots=grid[1].view(later, count),
            sampling=sampling,
            lists=lists,
            choice=choice,
        )

    def _forward(
        self, plan: StepPlan, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, list[int]]:
        """The logits of every row that samples (the model's dtype), and each request's first row among them."""
        columns = plan.columns
        sampled = columns.sampled_rows
        first = np.cumsum(sampled) - sampled  # each request's first row among the sampled ones
        # A request's sampled rows are the last of its query tokens: from its end less their count.
        ends = np.cumsum(columns.num_query_tokens)
        rows = np.repeat(ends - sampled - first, sampled) + np.arange(int(sampled.sum()))
        logits = self._logits(
            metadata,
            input_ids,
            position_ids,
            rows,
            max_list_len=self._max_list_len(plan.scheduled),
            prefill=plan.has_prefill,
        )
        return logits, first.tolist()

    def _plain_batch(self, plan: StepPlan) -> PlainBatch | None:
        """The columns of a plain decoding step's requests (no speculation, every request fed its newest token),
        kept while the step's requests and their slot-table rows stay the same; None where the step is built by
        ``MetadataBuilder.build`` and selects by ``TokenPicker.pick`` (a prompt chunk, a policy, a request whose
        sampling ``PlainBatch`` does not cover)."""
        if self.policy is not None or plan.has_prefill:
            return None
        requests = list(map(attrgetter("request"), plan.scheduled))
        rows = self.builder.rows(plan)
        held_ids, held_rows, held = self._plain
        ids = list(map(id, requests))  # the held batch holds its requests: their ids stay theirs
        if ids == held_ids and np.array_equal(rows, held_rows) and held.reads(self.table):
            return held
        batch = PlainBatch.of(requests, rows, self.table, self.ops.top_k_positions, self.ops.warped_sample)
        self._plain = (ids, rows, batch) if batch is not None else (None, None, None)
        return batch

    def _max_list_len(self, items: Sequence[ScheduledRequest]) -> int:
        """A bound on the full lists of ``items`` for graph buckets (0 without graphs: nothing reads it): the
        longest any request of the generation may reach (``list_bound``, set by the engine), so that a bucket
        made before every request was admitted is not outgrown (and captured again) when a longer one runs."""
        if self.graphs is None:
            return 0
        self.list_bound = max(self.list_bound, *(item.request.max_total_tokens for item in items))
        return self.list_bound + self.num_draft_slots

    def _logits(
        self,
        metadata: AttentionMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        rows: Sequence[int] | np.ndarray,
        *,
        max_list_len: int,
        prefill: bool = False,
    ) -> torch.Tensor:
        """The logits of the packed tokens ``rows`` in the model's dtype (token selection computes in fp32 from
        them; an fp32 copy of a verify's 2,304 x 49K bf16 rows is 450 MB to write): a graph replay where the
        step fits one (its full lists bounded by ``max_list_len``), else the model's forward."""
        if self.graphs is not None and self.graphs.eligible(metadata, prefill):
            logits = self.graphs.logits(input_ids, position_ids, metadata, rows, max_list_len)
        else:
            context = PagedForwardContext(metadata=metadata, pool=self.pool, ops=self.ops)
            with forward_context(context):
                output = self.forward(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    use_cache=False,
                    logits_to_keep=to_device(rows, self.device),
                )
            logits = output.logits[0]
        return logits

    def _learn_from_verify(self, plan: StepPlan, metadata: AttentionMetadata) -> None:
        """Hand the step's verify attention mass ``[layers, Hkv, verifies, width]`` (stacked on the device; each
        verify's positions in its row) to the policy, with each learning verify's row and context; those and the
        scored counts come from the plan, not from the device. A round launched ahead (``bound``) may start up to
        ``ahead - 1`` positions before the host's bound: its first query is handed over as the earliest it can
        be, so the positions it may hold count as recent (always read by the next drafts) and never as
        candidates of the policy's Top-K (they would then be read twice, or, past the true start, not at all)."""
        if self.policy is None:
            return
        full_items = plan.scheduled[metadata.num_drafts :]
        scored = self.builder.scored_queries(full_items)
        requests, rows, contexts, first_queries = [], [], [], []
        for row, (item, count) in enumerate(zip(full_items, scored, strict=True)):
            if item.samples and item.learns:
                context = item.first_position + item.num_query_tokens
                requests.append(item.request)
                rows.append(row)
                contexts.append(context)
                first_queries.append(context - (count or item.num_query_tokens) - (item.ahead - 1 if item.bound else 0))
        if not requests:
            return
        stacked = None
        if any(scored) and self.policy.sparse_layers:
            # Read in place, cut to the longest context: a graph's mass is as wide as any request may grow (W1:
            # 8.4K positions at every context).
            stacked = metadata.mass[..., : max(contexts)]
        self.policy.on_verifies(requests, stacked, rows, contexts, first_queries)

    def collect(self, step: LaunchedStep) -> list[StepResult]:
        """Each request's results, from the one read-back of a launched step (waits for that step alone). The
        read-back holds, for the first forward, each row's argmax (or draft draw) and the emitting requests'
        (verifies', final prompt chunks') accepted counts and next tokens; then the draft tokens of the later
        chain forwards (``Runner._later_drafts``'s matrix, row after row); then the accepted counts and next tokens
        of the verify forward of the step's rounds."""
        plan, first = step.plan, step.first
        values = _split(step.readback.tolist(), step.part_sizes)
        chain_end = 4 if step.num_chain_forwards else 3
        first_values, verify_values = values[:3], values[chain_end:]
        later = values[3] if step.num_chain_forwards else []  # forward j's draft of request i at (j - 1) * D + i
        num_drafts = plan.num_drafts
        entropies = [] if step.entropies is None else step.entropies.tolist()
        verify_rows = iter(step.verify.first_row if step.verify is not None else [])
        results = []
        for index, (item, row) in enumerate(zip(plan.scheduled, first.first_row, strict=True)):
            if not item.samples:
                results.append(StepResult())
            elif item.phase is Phase.DRAFT:
                drafts = [first_values[0][row], *later[index::num_drafts][: item.chain - 1]]
                if item.verifies:
                    result = step.verify.result(next(verify_rows), drafts, *verify_values)
                else:
                    result = StepResult(draft_entropy=entropies[row] if entropies else None)
                result.draft_tokens = drafts
                results.append(result)
            else:
                drafts = item.request.round.tokens if item.phase is Phase.VERIFY else []
                results.append(first.result(row, drafts, *first_values[1:]))
        return results


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


class _Span:
    """Milliseconds from its creation to ``stop()`` as the device runs them: CUDA events on a GPU (read once the
    step is collected, so reading never waits), the host clock elsewhere (where work runs as it is queued)."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start, self.end = time.perf_counter(), None

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.end = time.perf_counter()

    def ms(self) -> float:
        """The span; on a GPU call it after the step's read-back (both events have run by then)."""
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1])
        return 1e3 * (self.end - self.start)


@dataclass
class _Pass:
    """A forward of a step whose verifies the step reads back: each request's first logits row, and where each
    verify's (or final prompt chunk's) accepted count and next token sit in the read-back."""

    first_row: list[int]
    emitting_rows: dict[int, int]  # first row of each emitting request -> its index in accepted / next_token
    kept: KeptRows | None = None

    def result(self, row: int, drafts: list[int], accepted: list[int], next_token: list[int]) -> StepResult:
        """The verified tokens of the request whose rows start at ``row``, given the drafts it checked (and their
        rows' scores and logits, where the request keeps them)."""
        index = self.emitting_rows[row]
        tokens = [*drafts[: accepted[index]], next_token[index]]
        result = StepResult(tokens=tokens, num_accepted=accepted[index])
        if self.kept is not None and row in self.kept.starts:
            kept, start = self.kept.on_host(), self.kept.starts[row]
            for name, rows in (("scores", kept.scores), ("raw_logits", kept.raw)):
                if rows is not None:
                    setattr(result, name, rows[start : start + len(tokens)])
        return result


@dataclass
class LaunchedStep:
    """A step queued on the device and not yet read back: what ``Runner.collect`` needs to make its results."""

    plan: StepPlan
    first: _Pass  # the step's first forward (every scheduled request)
    verify: _Pass | None  # the verify forward of the rounds drafted in this step, in draft order
    part_sizes: list[int]  # lengths of the read-back's parts (see ``Runner.collect``)
    num_chain_forwards: int  # later forwards of the step's draft chains (0: none, nothing read back for them)
    readback: _Readback
    entropies: _Readback | None  # draft rows' entropies, for policies that steer by them
    chain_span: _Span | None  # the later forwards of its draft chains, back to back (None: none ran)


def _split(values: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """Consecutive pieces of ``sizes`` items."""
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [values[start:end] for start, end in itertools.pairwise(bounds)]
