"""CUDA graphs for decoding steps: any mix of draft steps and verify (or plain decode) steps, no prefill.

A step's eager forward costs the host a Python call per module and a launch per kernel (tens of ms for a
30-layer model at batch 256, far above the GPU time of the step). Here the forward of a step padded to a
bucket is captured once and replayed: every step copies its inputs, slot lists and query offsets into the
bucket's static buffers (fixed addresses the graph reads) and replays. A bucket is (draft requests, verify
requests), each padded to a bucket size; every verify request has room for ``verify_tokens`` (k + 1) query
tokens, so the unified batch of the phase scheduler (~B/(k+1) verifies next to ~B k/(k+1) drafts) reuses a
few graphs. A step whose bucket was never made replays a made one of up to twice its size, or of up to
``SMALL_BUCKET`` requests for a small step (``held_bucket``).

Static layout of a bucket (D' drafts, V' verifies, q tokens each): tokens ``[D real drafts | D' - D padding
drafts | verify tokens | padding]``; padding drafts own one token, an empty slot list and the scratch slot;
padding verifies own no token and an empty list; trailing padding tokens belong to no request (their rows
are computed and never read). Exact on replay because the kernels read every query offset and list length
from the device and adapt their split sizes to them (and, in a small bucket, their split counts to its real
requests: ``LiveRequests``); the launch hints fixed at capture only affect speed.
On a CPU the same static path runs without capture (tested in CI: same tokens as the dynamic path).

A plain step of a ``PlainBatch`` (torchspec/plain_batch.py) goes further: its graph also builds the step's inputs
from the slot table before the forward and selects its tokens and advances the table after it, so the host
copies nothing in but a batch's columns when the batch changes, and reads back only the tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TypeVar

import numpy as np
import torch

from attention.reference import MASS_DTYPE
from torchspec.draft_lists import DraftChoice
from torchspec.hf import PagedForwardContext, forward_context, verify_mass_buffer, verify_mass_shape
from torchspec.kv_cache import KVPool
from torchspec.plain_batch import PlainBatch
from torchspec.step import AttentionMetadata, KVView
from torchspec.transfer import to_device

T = TypeVar("T")


# A step replays a bucket already made of up to this many times its own bucket's size in each dimension rather
# than capture its own: a capture costs ~50 ms of host time with the GPU idle (W1 on the H200: 66 captures, 3.4 s
# of a 44.7 s run, most of them for the buckets a draining batch passes through), a padding request only its rows
# of the GEMMs and the LM head (its attention lists are empty, its rows never sampled).
PADDING_SLACK = 2
# ... and a step of at most this many requests in a dimension replays any made bucket of at most this many there:
# below it a forward costs the GPU its weights and its launches, the same for one request as for 32 (the K/V its
# requests read is a few MB), while a capture costs the host 50-400 ms. W1's draining batch on an H100 (run AD,
# pillar_recent, session 44) captured its step and chain graphs anew at 8, 2 and 1 requests: 1.2 s of a 41.4 s run.
SMALL_BUCKET = 32


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Padded request counts: powers of two to 32, then every 32 (a step pads at most 31 requests past 32)."""
    small = [size for size in (1, 2, 4, 8, 16, 32) if size < max_batch_size]
    return [*small, *range(64, max_batch_size, 32), max_batch_size]


def held_bucket(counts: tuple[int, ...], sizes: Sequence[int], made: Collection[tuple[int, ...]]) -> tuple[int, ...]:
    """The bucket a step of ``counts`` requests (one count a dimension) replays in: its own (each count padded to
    the next of ``sizes``, none where it has none) when made, else the smallest made bucket holding it within
    ``PADDING_SLACK`` times its own, or ``SMALL_BUCKET``, in every dimension (none where it has none), else its
    own (to be made)."""
    own = tuple(next(size for size in sizes if size >= count) if count else 0 for count in counts)
    if own in made:
        return own

    def pads(need: int, size: int) -> bool:
        return need <= size <= max(PADDING_SLACK * need, SMALL_BUCKET) if need else size == 0

    holding = [key for key in made if all(pads(need, size) for need, size in zip(own, key, strict=True))]
    return min(holding, key=sum, default=own)


class LiveRequests:
    """How many drafts and other requests of a small bucket's step are real, on the device where its attention
    reads them (``AttentionMetadata.live_requests``): a bucket of at most ``SMALL_BUCKET`` requests in every
    dimension replays steps of 1 to 32 requests, and the split counts fixed at its capture were planned for all of
    its rows (at 2 requests in a bucket of 32, 5-11 splits where 32 fill the GPU); its attention grows them to
    fill a wave with the real ones. Larger buckets replay steps of at least half their size and have none."""

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(2, dtype=torch.int64, device=device)
        self._held = (0, 0)

    @staticmethod
    def of(bucket: tuple[int, ...], device: torch.device) -> LiveRequests | None:
        return LiveRequests(device) if max(bucket) <= SMALL_BUCKET else None

    def count(self, drafts: int, others: int) -> None:
        """The step's real requests, written when they change (a copy costs the host a dispatch)."""
        if self._held != (drafts, others):
            self.tensor.copy_(to_device([drafts, others], self.tensor.device))
            self._held = (drafts, others)


class SharedStorage:
    """One flat storage that the buffers of graphs never running at the same time take views of: each is filled
    before its graph replays, or written by its graph and read before the next forward runs (one stream). A
    buffer per bucket multiplied the memory by the buckets a draining batch passes (at 1,024 requests, 36 of
    them: ~26 GB of verify mass alone; W3 ran out of memory). A view larger than the storage gets a new one;
    graphs captured before keep theirs."""

    def __init__(self, dtype: torch.dtype, device: torch.device, largest_bucket: int) -> None:
        self.dtype = dtype
        self.device = device
        self.largest_bucket = largest_bucket
        self._storage: torch.Tensor | None = None

    def view(self, shape: Sequence[int], bucket: int) -> torch.Tensor:
        """A zeroed ``shape`` view of the storage for a bucket of ``bucket`` requests; a new storage has room for
        the same view scaled to the largest bucket (the larger buckets to come)."""
        needed = math.prod(shape)
        if self._storage is None or self._storage.numel() < needed:
            reserve = needed * self.largest_bucket // bucket
            self._storage = torch.empty(max(needed, reserve), dtype=self.dtype, device=self.device)
        return self._storage[:needed].view(*shape).zero_()


@dataclass
class _StaticStep:
    """One bucket's fixed-address inputs and metadata, and (once captured) its graph and outputs."""

    num_drafts: int  # D'
    num_verifies: int  # V'
    input_ids: torch.Tensor  # [1, T']
    position_ids: torch.Tensor  # [1, T']
    rows: torch.Tensor  # [T']: token rows whose logits the step keeps (padding: row 0)
    metadata: AttentionMetadata
    draft_capacity: int  # entries each draft-list buffer holds
    full_capacity: int
    draft_lists: torch.Tensor | None = None  # [sparse layers, Hkv, capacity]: every layer's draft lists
    kept_rows: np.ndarray | None = None  # what ``rows`` holds now (rewritten only when it changes)
    reason: str = "new bucket"  # why the bucket's buffers were made (its capture is logged with it)
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [T', V]: its view of the logits every bucket shares (first forward on)
    # A plain step's batch (``torchspec.plain_batch``), whose inputs the forward builds from the slot table and
    # whose tokens it selects after it: the bucket's columns, the batch they hold now (rewritten only when it
    # changes) and each row's token.
    plain: PlainBatch | None = None
    plain_source: PlainBatch | None = None
    tokens: torch.Tensor | None = None  # [T']
    live: LiveRequests | None = None  # its real requests (``metadata.live_requests``), in a small bucket


class StepGraphs:
    """Captures and replays the forward of decoding steps padded to (draft, verify) buckets."""

    def __init__(
        self,
        forward: Callable[..., object],
        pool: KVPool,
        ops: ModuleType,
        sparse_layers: dict[int, int],
        verify_tokens: int,
        scored_queries: int,
        max_batch_size: int,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> None:
        self.forward = forward
        self.pool = pool
        self.ops = ops
        self.sparse_layers = sparse_layers  # draft-reading layer -> its KV heads
        # Every draft-reading layer's view shares one indptr and length: the first one speaks for all.
        self.first_sparse = next(iter(sparse_layers), None)
        self.verify_tokens = verify_tokens  # query tokens a verify request may hold (k + 1; 1 without drafts)
        self.scored_queries = scored_queries  # a verify's queries PillarAttn learns the attention mass of (0: none)
        self.buckets = bucket_sizes(max_batch_size)
        self.device = device
        self.generator = generator  # the run's, which plain steps draw their seeds from
        self.capture = device.type == "cuda"
        # By bucket and the layout of the step's token batch (None: the runner selects after the replay).
        self._steps: dict[tuple[int, int, tuple | None], _StaticStep] = {}
        self._last: _StaticStep | None = None  # the bucket replayed most recently
        self._mass = SharedStorage(MASS_DTYPE, device, self.buckets[-1])  # every bucket's verify mass
        self._draft_lists = SharedStorage(torch.int64, device, self.buckets[-1])  # every bucket's draft lists
        # Every bucket's logits, typed by the first forward. A graph keeping its own logits held them as long as
        # it lived: W3's ~100 step buckets kept 5.3 GiB, which an H100 run with offload (its batch changing more
        # often) ran out of memory against.
        self._logits: SharedStorage | None = None
        # One memory pool for every step graph's intermediates (they never replay at the same time and keep no
        # output in it), so the graphs together take what the largest one needs, not the sum of all.
        self.memory = GraphPool(device) if self.capture else None
        self.captures = CaptureLog()

    def eligible(self, metadata: AttentionMetadata, prefill: bool) -> bool:
        """No prefill chunk, no query longer than a verify, nothing chosen inside the forward on the host
        (query-aware draft selection that does not choose on the device) and no sliding-window layers."""
        return (
            not prefill
            and metadata.max_q_len <= self.verify_tokens
            and metadata.draft_select is None
            and not metadata.windowed
        )

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        metadata: AttentionMetadata,
        rows: Sequence[int] | np.ndarray,
        max_list_len: int,
    ) -> torch.Tensor:
        """The logits of ``rows`` (token indices of the dynamic packing), from the step's bucket graph, replayed
        (captured on first use, and again when the slot lists outgrow the buffers). Fills ``metadata.mass``
        with the bucket's verify scores. ``max_list_len`` bounds the running requests' full lists over their
        whole generation: a launch hint, and the width of the verify mass (a request whose list outgrows the
        bucket's bound, one admitted later with a longer budget, captures the bucket again)."""
        num_drafts = metadata.num_drafts
        num_verifies = metadata.full.kv_indptr.shape[0] - 1
        lists = num_drafts > 0 and metadata.draft_choice is None  # the runner built the draft lists
        draft_count = metadata.draft[self.first_sparse].kv_indices.shape[-1] if lists else 0
        full_count = metadata.full.kv_indices.shape[-1]
        key, step, reason = self._held((num_drafts, num_verifies), None, full_count, metadata.full.max_len)
        choice, held_choice = metadata.draft_choice, None if step is None else step.metadata.draft_choice
        if reason is None and choice is not None and (held_choice is None or not choice.held_by(held_choice)):
            reason = "draft choice outgrew its buffers"
        elif reason is None and draft_count > step.draft_capacity:
            reason = "draft lists outgrew its buffer"
        if reason is not None:
            draft_hint = metadata.draft[self.first_sparse].max_len if lists else 0
            step = self._remake(key, step, reason, full_count, max_list_len, draft_count, draft_hint, choice)
        self._fill(step, input_ids, position_ids, metadata, rows)
        logits = self._replay(step)
        # Verify j's row is the dynamic step's: real verifies come first.
        metadata.mass, metadata.mass_layers = step.metadata.mass, step.metadata.mass_layers
        return logits[: len(rows)]

    def plain_tokens(self, batch: PlainBatch, contexts: np.ndarray, max_list_len: int) -> torch.Tensor:
        """A plain step of ``batch``'s requests, each ``contexts[i]`` tokens long with the one it is fed, from
        the bucket's graph: its inputs built from the slot table, the forward, then each request's token
        selected and the table advanced past the step (``torchspec.plain_batch``), all on the device. The host
        only copies a batch's columns in when the batch changes, draws the seed and replays. ``max_list_len``: as
        for ``logits``."""
        count = len(contexts)
        full_count, longest = int(contexts.sum()), int(contexts.max())
        key, step, reason = self._held((0, count), batch.layout(), full_count, longest)
        if reason is None and not step.plain.reads(batch):
            reason = "slot table grew"
        if reason is not None:
            step = self._remake(key, step, reason, full_count, max_list_len, batch=batch)
        self._keep(step, np.arange(count))
        if step.live is not None:
            step.live.count(0, count)
        if step.plain_source is not batch:
            batch.copy_into(step.plain)
            step.plain_source = batch
        step.plain.draw_seed(self.generator)
        self._replay(step)
        return step.tokens[:count]

    def _held(
        self, counts: tuple[int, int], layout: tuple | None, full_count: int, longest: int
    ) -> tuple[tuple, _StaticStep | None, str | None]:
        """The bucket a step of ``counts`` (drafts, verifies) replays in among those of its batch ``layout``
        (None: the runner's), its buffers, and why they must be made (again) or None: whether they hold
        ``full_count`` list entries of at most ``longest`` positions a list."""
        made = [key[:2] for key in self._steps if key[2] == layout]
        key = (*held_bucket(counts, self.buckets, made), layout)
        step = self._steps.get(key)
        if step is None:
            return key, None, "new bucket"
        if full_count > step.full_capacity or longest > step.metadata.full.max_len:
            return key, step, "full lists outgrew its buffer"
        return key, step, None

    def _remake(
        self,
        key: tuple,
        step: _StaticStep | None,
        reason: str,
        full_count: int,
        max_list_len: int,
        draft_count: int = 0,
        draft_hint: int = 0,
        choice: DraftChoice | None = None,
        batch: PlainBatch | None = None,
    ) -> _StaticStep:
        """A bucket's buffers made anew, for ``reason``, with room for twice what is asked now."""
        step = self._steps[key] = self._static_step(
            *key[:2],
            draft_capacity=max(2 * draft_count, 2 * step.draft_capacity if step else 0),
            full_capacity=max(2 * full_count, key[1] * max_list_len),
            draft_hint=draft_hint,
            full_hint=max_list_len,
            choice=choice,
            batch=batch,
        )
        step.reason = reason
        return step

    def _replay(self, step: _StaticStep) -> torch.Tensor:
        """Run the bucket's forward and return its logits: replayed, or where it was never captured, captured,
        its capture's warm-up run being this step's (run twice, a plain step would advance the table twice)."""
        self._last = step
        if not self.capture:
            return self._run_forward(step)
        if step.graph is None:
            self._capture(step)
        else:
            step.graph.replay()
        return step.logits

    def _static_step(
        self,
        num_drafts: int,
        num_verifies: int,
        draft_capacity: int,
        full_capacity: int,
        draft_hint: int,
        full_hint: int,
        choice: DraftChoice | None,
        batch: PlainBatch | None,
    ) -> _StaticStep:
        """A bucket's buffers; its drafts choose their lists in the forward from buffers like ``choice`` (None:
        they read lists the runner built), and its tokens are selected after the forward with columns like
        ``batch``'s (None: by the runner)."""
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=self.device)  # noqa: E731
        num_tokens = num_drafts + num_verifies * self.verify_tokens
        position_ids = zeros(1, num_tokens)
        draft_lists, draft = None, {}
        if choice is not None:
            choice = choice.padded(num_drafts, position_ids[0, :num_drafts])
        elif num_drafts:
            indptr, ends = zeros(num_drafts + 1), zeros(num_drafts)
            draft_lists = self._draft_lists.view(
                (len(self.sparse_layers), max(self.sparse_layers.values()), draft_capacity), num_drafts
            )
            draft = {
                layer: KVView(indptr, draft_lists[i, :heads], draft_hint, ends)
                for i, (layer, heads) in enumerate(self.sparse_layers.items())
            }
        cu_seqlens_q = zeros(num_drafts + num_verifies + 1)
        cu_seqlens_q[: num_drafts + 1] = torch.arange(num_drafts + 1, device=self.device)  # drafts: one token each
        scored = self.scored_queries > 0 and num_verifies > 0
        mass, mass_layers = None, {}
        if scored:
            mass, mass_layers = self._mass_buffer(num_verifies, full_hint)
        live = LiveRequests.of((num_drafts, num_verifies), self.device)
        metadata = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), self.pool.scratch_slot, dtype=torch.int64, device=self.device),
            cu_seqlens_q=cu_seqlens_q,
            windowed={},
            full=KVView(zeros(num_verifies + 1), zeros(full_capacity), full_hint),
            num_drafts=num_drafts,
            draft=draft,
            draft_choice=choice,
            num_scored_queries=zeros(num_verifies) if scored else None,
            max_q_len=self.verify_tokens if num_verifies else 1,
            max_scored_queries=self.scored_queries,
            mass=mass,
            mass_layers=mass_layers,
            live_requests=None if live is None else live.tensor,
        )
        return _StaticStep(
            num_drafts=num_drafts,
            num_verifies=num_verifies,
            input_ids=zeros(1, num_tokens),
            position_ids=position_ids,
            rows=zeros(num_tokens),
            metadata=metadata,
            draft_capacity=draft_capacity,
            full_capacity=full_capacity,
            draft_lists=draft_lists,
            plain=None if batch is None else batch.buffers(num_tokens),
            tokens=None if batch is None else zeros(num_tokens),
            live=live,
        )

    def _mass_buffer(self, num_verifies: int, width: int) -> tuple[torch.Tensor, dict[int, int]]:
        """A bucket's verify mass, a view of the storage every bucket shares (PillarAttn's Top-K reads a step's
        mass before the next forward), with room for the largest bucket."""
        shape = verify_mass_shape(self.sparse_layers, num_verifies, width)
        return verify_mass_buffer(
            self.sparse_layers, num_verifies, width, self.device, out=self._mass.view(shape, num_verifies)
        )

    def _fill(
        self,
        step: _StaticStep,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        metadata: AttentionMetadata,
        rows: Sequence[int] | np.ndarray,
    ) -> None:
        """Copy the step into the bucket's buffers (see the module docstring for the layout). Copies of empty
        ranges are skipped and the kept rows are rewritten only when they change: each tensor op costs the host
        a dispatch, and a round runs k + 1 of these fills."""
        static, drafts, padded_drafts = step.metadata, metadata.num_drafts, step.num_drafts
        tokens = input_ids.shape[1]
        verify_tokens = tokens - drafts
        static.slot_mapping.fill_(self.pool.scratch_slot)
        for source, target in (
            (input_ids[0], step.input_ids[0]),
            (position_ids[0], step.position_ids[0]),
            (metadata.slot_mapping, static.slot_mapping),
        ):
            if drafts:
                target[:drafts] = source[:drafts]
            if verify_tokens:
                target[padded_drafts : padded_drafts + verify_tokens] = source[drafts:]
        shift = padded_drafts - drafts
        rows = np.asarray(rows, dtype=np.int64)
        self._keep(step, np.where(rows < drafts, rows, rows + shift))
        if step.live is not None:
            step.live.count(drafts, metadata.full.kv_indptr.shape[0] - 1)
        if metadata.draft_choice is not None:
            metadata.draft_choice.copy_into(static.draft_choice)
        elif drafts:
            lists, target = metadata.draft[self.first_sparse], static.draft[self.first_sparse]
            _copy_padded(target.kv_indptr, lists.kv_indptr)
            # Padding drafts' lists start and end where the real ones end.
            target.kv_ends[:drafts] = lists.kv_indptr[1:] if lists.kv_ends is None else lists.kv_ends
            target.kv_ends[drafts:] = lists.kv_indptr[-1]
            step.draft_lists[..., : lists.kv_indices.shape[-1]] = metadata.draft_lists
        if step.num_verifies:
            _copy_padded(static.cu_seqlens_q[padded_drafts:], metadata.cu_seqlens_q[drafts:] + shift)
            _copy_padded(static.full.kv_indptr, metadata.full.kv_indptr)
            static.full.kv_indices[: metadata.full.kv_indices.shape[-1]] = metadata.full.kv_indices
            if static.num_scored_queries is not None:
                static.num_scored_queries.zero_()
                if metadata.num_scored_queries is not None:
                    static.num_scored_queries[: metadata.num_scored_queries.shape[0]] = metadata.num_scored_queries

    def _keep(self, step: _StaticStep, kept: np.ndarray) -> None:
        """The token rows whose logits the bucket keeps (the rest: row 0), written when they change."""
        if step.kept_rows is None or not np.array_equal(kept, step.kept_rows):
            step.rows.zero_()
            step.rows[: kept.size] = to_device(kept, self.device)
            step.kept_rows = kept

    def _run_forward(self, step: _StaticStep) -> torch.Tensor:
        """The bucket's forward on its buffers: a plain step's inputs built from the slot table first and its
        tokens selected after (both on the device: what a graph captures)."""
        if step.plain is not None:
            step.plain.write_inputs(step.input_ids, step.position_ids, step.metadata, self.pool.scratch_slot)
        context = PagedForwardContext(metadata=step.metadata, pool=self.pool, ops=self.ops)
        with forward_context(context):
            output = self.forward(
                input_ids=step.input_ids, position_ids=step.position_ids, use_cache=False, logits_to_keep=step.rows
            )
        logits = output.logits[0]
        if step.logits is None:  # the bucket's first forward: never inside a capture, which runs once before it
            if self._logits is None:  # room for the most tokens a step holds: every request a verify and a draft
                largest_step = self.buckets[-1] * (1 + self.verify_tokens)
                self._logits = SharedStorage(logits.dtype, self.device, largest_step)
            step.logits = self._logits.view(logits.shape, logits.shape[0])
        step.logits.copy_(logits)
        if step.plain is not None:
            step.tokens.copy_(step.plain.tokens(step.logits))
        return step.logits

    def _capture(self, step: _StaticStep) -> None:
        # The list-length hints its attention launches are planned for (split counts fixed in the graph).
        draft = step.metadata.draft.get(self.first_sparse)
        hints = ("" if draft is None else f"draft lists to {draft.max_len}, ") + f"full to {step.metadata.full.max_len}"
        label = f"step {step.num_drafts}+{step.num_verifies} ({hints}): {step.reason}"
        step.graph, _ = self.captures.capture(lambda: self._run_forward(step), label, self.memory)

    def replay_latest(self, repeats: int) -> None:
        """Replay the latest bucket's graph ``repeats`` times back to back, with no host work in between (for
        benchmarks and profiles; the replays rewrite the same K/V)."""
        assert self._last is not None and self._last.graph is not None, "no captured step replayed yet"
        for _ in range(repeats):
            self._last.graph.replay()

    def replay_ms(self, repeats: int = 20) -> float:
        """GPU time of one replay of the latest bucket: the device time of a step's forward alone."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.replay_latest(repeats)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    @property
    def num_captured(self) -> int:
        return sum(step.graph is not None for step in self._steps.values())


@dataclass
class CaptureLog:
    """Graph captures so far, the host seconds they took and why each was made (a draining batch captures at
    new buckets, growing lists capture a bucket again; the throughput benchmark reports all three)."""

    count: int = 0
    seconds: float = 0.0
    events: list[tuple[str, float]] = field(default_factory=list)  # (what and why, seconds), in order

    def capture(
        self, run: Callable[[], T], label: str, pool: GraphPool | None = None
    ) -> tuple[torch.cuda.CUDAGraph, T]:
        """``capture_graph(run)`` into ``pool``, counted and logged under ``label`` (the graph and why it was made)."""
        start = time.perf_counter()
        captured = capture_graph(run, None if pool is None else pool.handle)
        seconds = time.perf_counter() - start
        self.count += 1
        self.seconds += seconds
        self.events.append((label, seconds))
        return captured

    def by_reason(self) -> dict[str, list[float]]:
        """``{why: [captures, seconds]}``: the labels without their bucket sizes and list-length hints."""
        totals: dict[str, list[float]] = {}
        for label, seconds in self.events:
            kind, _, why = label.partition(": ")
            entry = totals.setdefault(f"{kind.split()[0]}: {why}", [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
        return totals


class GraphPool:
    """A memory pool shared by graphs that never replay at the same time, alive as long as this object is. A bare
    ``torch.cuda.graph_pool_handle()`` lives only while some graph captured into it does: once re-capturing a bucket
    had dropped the pool's only graphs, the next capture into it failed in PyTorch's allocator ("use_count > 0
    INTERNAL ASSERT FAILED"; query_sketch's draft-chain graphs on an H100, where a growing draft choice re-captured
    the one bucket of a warm-up). A graph of one small kernel, captured into the pool first, holds it."""

    def __init__(self, device: torch.device) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self._holder, _ = capture_graph(lambda: torch.zeros(1, device=device), self.handle)


def capture_graph(run: Callable[[], T], pool: tuple | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``run`` (fixed-address inputs and outputs) as a CUDA graph, after one warm-up run on a side
    stream (kernels compile, lazy library state is set up outside the capture); returns the graph and the
    captured run's output. The warm-up does what a replay does (same writes): a step graph's caller takes it as
    the step's run, and replays from the next step on (a run that is not idempotent, as a plain step's advancing
    the slot table, must not run again after it). One warm-up,
    not the customary few: a draining batch captures at every bucket (W1 on the H200 spent ~12.5 of 68-75 s in
    ~170 captures; skipping the warm-up of a bucket's later draft forwards did not shorten that). Each graph
    gets a private memory pool (a re-captured bucket frees its old graph safely) unless ``pool`` names one it
    shares with graphs that never run at the same time and keep no output in it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


def _copy_padded(target: torch.Tensor, source: torch.Tensor) -> None:
    """An offsets array into a longer one: the entries past the source's repeat its last (empty ranges)."""
    target[: source.shape[0]] = source
    target[source.shape[0] :] = source[-1]
