"""The loop: plan -> run -> commit, until every request is finished; per-request checks and stats."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence

import torch

import attention
from torchspec.config import SpecConfig
from torchspec.drafting import DraftPolicy, make_policy
from torchspec.fused_layers import FusedLayers
from torchspec.hf import model_dtype_forwards, replaced_forwards, routed_attention
from torchspec.kv_cache import (
    KVPool,
    LayerSpec,
    auto_capacity_tokens,
    bytes_per_token,
    step_list_bytes,
    step_workspace_bytes,
)
from torchspec.kv_offload import RESTORE_STAGING_BYTES, OffloadStats, auto_host_capacity_tokens, restore_step_tokens
from torchspec.parallel.group import TensorParallel
from torchspec.request import FinishReason, Request, SamplingParams
from torchspec.runner import LaunchedStep, Runner
from torchspec.scheduler import Scheduler
from torchspec.stats import GenerationStats, accepted_histogram
from torchspec.step import StepPlan

StepCallback = Callable[[StepPlan, list[Request]], None]
# Where the host's time per step goes (``GenerationStats.host_ms``): choosing the step (and its KV moves),
# queueing its device work, waiting for and reading its results, applying them to the requests.
HOST_PHASES = ("schedule", "launch", "read-back", "commit")
DEFAULT_STEP_TOKENS = 2048  # query tokens per step unless a full batch of verifies needs more
DEFAULT_CONTEXT_BOUND = 32768  # a request's longest context where the model's config names none
DEFAULT_DRAFT_STEP_BUDGET = 1 << 16  # KV tokens a step's drafts read together on a GPU (see use_draft_step_budget)


def use_cuda_graphs(setting: bool | None, device: torch.device, ops: object) -> bool:
    """Whether the runner captures CUDA graphs: ``None`` = on with CUDA unless the attention backend is the
    reference, whose loops read the slot lists on the host (a sync that a capture forbids). On a CPU,
    ``True`` runs the same padded static path without capture, whatever the backend."""
    capturable = ops is not attention.reference
    if setting and device.type == "cuda" and not capturable:
        raise ValueError(
            "cuda_graphs=True cannot capture attention_backend='reference' (it reads the slot lists on the host); "
            "use attention_backend='auto', 'triton' or 'flex', or cuda_graphs=False"
        )
    return device.type == "cuda" and capturable if setting is None else setting


def use_draft_step_budget(setting: int | None, device: torch.device) -> int:
    """KV tokens a step's drafts may read together (``SpecConfig.draft_step_budget``): ``None`` = 65,536 on a GPU,
    where a forward of few requests costs its launches and weight reads whatever it attends to, and 0 on a CPU.
    Measured on W1 (H200, docs/performance.md runs G and H): 65,536 (256 positions a request at full batch, 8K at
    8 requests) made 44.7K tok/s where 0 made 36.5K (run G), and 42.6K where 32,768 made 33.9K with 11 s of
    mid-run Top-K compiles, since served by the reference (run H): a larger floor drafts better at full batch
    (6.79 accepted of 8 against 6.50) for rounds 10% longer, and better again as the batch drains."""
    if setting is not None:
        return setting
    return DEFAULT_DRAFT_STEP_BUDGET if device.type == "cuda" else 0


def use_budget_by_misses(
    setting: bool | None, policy: DraftPolicy | type[DraftPolicy] | None, device: torch.device
) -> bool:
    """Whether each request's draft budget is weighted by its recent misses (``SpecConfig.budget_by_misses``):
    ``None`` = on with CUDA for sparse drafts other than ``query_sketch`` (its budgets bound its device lists),
    off on a CPU like the step budget it weighs. Measured on W1 on three H100s: +2.0%, +1.2% and +3.9% against
    even budgets in the same run (docs/performance.md)."""
    if setting is not None:
        return setting
    sparse = policy is not None and not policy.proposes_tokens and policy.name != "query_sketch"
    return sparse and device.type == "cuda"


def use_draft_chain(
    setting: bool | None, policy: DraftPolicy | type[DraftPolicy] | None, unified_schedule: bool
) -> bool:
    """Whether a request drafts its whole round in one step: ``None`` = wherever the policy (or its class)
    allows it (it has draft steps, and does not decide between them whether to go on) and the schedule does
    (the unified schedule staggers rounds one forward per step)."""
    if policy is None or policy.proposes_tokens:
        return False
    if policy.uses_draft_entropy:
        conflict = (
            f"draft={policy.name!r}: it decides after each draft, from that draft's entropy on the host, whether "
            "to draft another; use draft_chain=None or False"
        )
    elif unified_schedule:
        conflict = (
            "unified_schedule=True: it staggers the requests' rounds over their phases, one forward per step, "
            "where a chain runs a whole round in one step; use draft_chain=None or False, or unified_schedule=False"
        )
    else:
        return setting is None or setting
    if setting:
        raise ValueError(f"draft_chain=True cannot run with {conflict}")
    return False


def use_adaptive_rounds(setting: bool, draft_chain: bool) -> bool:
    """Whether each step's round length is chosen from measured costs (torchspec/round_length.py); it needs
    draft chains, where a step is a whole round and its cost can be timed."""
    if setting and not draft_chain:
        raise ValueError(
            "adaptive_rounds=True needs draft chains (a step must be a whole round to time it): use a draft "
            "policy that drafts in chains (not draft=None, 'ngram' or 'sparsespec_l') with draft_chain=None or True "
            "and unified_schedule=False"
        )
    return setting


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Leave every object that exists before the run out of the garbage collector's passes while it runs: a
    full collection walks the whole heap (the model, transformers, the caller's own objects: ~0.25 s for
    ~400K objects on a CPU), and a long run triggers several, each stalling a step. Objects made during the
    run are collected as usual, but for those frozen in turn as requests start or come back (``_freeze_started``); the
    frozen ones are handed back at the end (``gc.unfreeze``), so garbage among them is still freed later, never
    leaked."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _freeze_started(plan: StepPlan) -> None:
    """Freeze the heap again (``_frozen_heap``) after a step in which requests start or come back from the host
    tier: each holds a new slot list from then on (W1: 256 lists of ~8.4K slots), and a full collection walks
    every item of every list, ~8 ms a pass that W1's plain decoding paid about every 100 steps (H100, session 43).
    Freezing is a constant-time splice."""
    if plan.restores or plan.has_prefill:
        gc.freeze()


class Engine:
    """Owns the KV pool and runs batches of requests to completion with continuous batching."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: SpecConfig,
        layers: Sequence[LayerSpec],
        generator: torch.Generator | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        self.model = model
        self.tensor_parallel = tensor_parallel
        self.config = config
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        text_config = model.config.get_text_config()
        self.context_length: int | None = getattr(text_config, "max_position_embeddings", None)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        ops = attention.load_ops(config.attention_backend, self.device)
        self.policy = make_policy(config, layers, ops)
        self.num_draft_slots = k = config.k if self.policy is not None else 0
        self.max_step_tokens = config.max_step_tokens or max(DEFAULT_STEP_TOKENS, config.max_batch_size * (k + 1))
        self.draft_step_budget = use_draft_step_budget(config.draft_step_budget, self.device) if k else 0
        capacity = config.kv_capacity_tokens or self._auto_capacity(layers)
        if tensor_parallel is not None:  # every rank admits the same requests: the smallest pool serves all
            capacity = tensor_parallel.agree_min(capacity)
        self.pool = KVPool(layers, capacity, self.dtype, self.device, self._sketched)
        self.model_dtype_forwards = model_dtype_forwards(model)  # installed for each run: no client's autocast
        fused = config.fuse_layers is not False
        self.fused_layers = FusedLayers(model, layers, ops, self.model_dtype_forwards) if fused else None
        self.host_kv_capacity_tokens = 0  # the host tier's K/V rows (``offload``)
        self.restore_step_tokens: int | None = None  # K/V rows a step brings back from there, at most
        if config.offload:
            token_bytes = bytes_per_token(layers, self.dtype, self._sketched)
            self.host_kv_capacity_tokens = config.host_kv_capacity_tokens or auto_host_capacity_tokens(token_bytes)
            self.restore_step_tokens = restore_step_tokens(token_bytes)
            if tensor_parallel is not None:
                self.host_kv_capacity_tokens = tensor_parallel.agree_min(self.host_kv_capacity_tokens)
        self.runner = Runner(
            model,
            self.pool,
            layers,
            ops,
            self.device,
            self.policy,
            generator,
            compile_model=bool(config.compile),
            cuda_graphs=use_cuda_graphs(config.cuda_graphs, self.device, ops),
            max_batch_size=config.max_batch_size,
            host_capacity_tokens=self.host_kv_capacity_tokens,
        )
        self.draft_chain = use_draft_chain(config.draft_chain, self.policy, config.unified_schedule)
        # Launch each step before reading the last one back (see SpecConfig). With speculation, a request's next
        # round launches while its last one is in flight where the runner places every draft list on the device
        # (not inside attention, no sliding window): rounds ahead, on by default on CUDA, where it was measured
        # (elsewhere speculation keeps the synchronous loop, reproducible step for step).
        ahead_capable = self.draft_chain and not self.policy.selects_in_attention and not self.runner.windows
        default = self.policy is None or (ahead_capable and self.device.type == "cuda")
        self.delayed_verify = default if config.delayed_verify is None else config.delayed_verify
        self.rounds_ahead = self.delayed_verify and ahead_capable
        self.adaptive_rounds = use_adaptive_rounds(config.adaptive_rounds, self.draft_chain)
        self.run_start = time.perf_counter()  # when the current (or last) run began
        self._run_steps = 0
        self.host_ms = dict.fromkeys(HOST_PHASES, 0.0)
        # Called with each step as it is applied (its plan and the requests it finished), whoever runs the steps:
        # a benchmark's timeline or profile window watches a run through it.
        self.observers: list[StepCallback] = []

    def _auto_capacity(self, layers: Sequence[LayerSpec]) -> int:
        """The automatic pool: what free memory holds after the step workspace and the step buffers that grow with
        the batch and its contexts (a draft chain's lists for its k - 1 later forwards, the verify mass) and, with
        ``offload``, the restores' staging."""
        config, k, policy = self.config, self.num_draft_slots, self.policy
        heads = {layer.layer_idx: layer.num_kv_heads for layer in layers}
        context_bound = self.context_length or DEFAULT_CONTEXT_BOUND
        per_step, per_request, per_token = step_list_bytes(
            sparse_kv_heads=sum(heads[layer] for layer in policy.sparse_layers) if policy is not None else 0,
            chain_forwards=max(1, k - 1),
            sparsity=config.sparsity,
            min_entries=config.min_budget + k,
            step_entries=self.draft_step_budget,
            context_bound=context_bound,
            scored=policy is not None and policy.uses_verify_scores,
        )
        workspace = step_workspace_bytes(self.max_step_tokens, config.max_batch_size, k, self.vocab_size)
        if config.offload:  # restores staged for the step in flight and the one launched behind it
            workspace += 2 * RESTORE_STAGING_BYTES
        return auto_capacity_tokens(
            layers,
            self.dtype,
            self.device,
            workspace_bytes=workspace + per_step + config.max_batch_size * per_request,
            host_ceiling_tokens=config.max_batch_size * context_bound,
            step_bytes_per_token=per_token,
            device_fraction=config.kv_memory_fraction,
            sketched=self._sketched,
        )

    @property
    def _sketched(self) -> frozenset[int]:
        """The layers whose keys the pool also keeps sketched (for the draft policy)."""
        return self.policy.sketched_layers if self.policy is not None else frozenset()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_slots

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming what is wrong with one request and how to fix it."""
        params.validate()
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt: give at least one token")
        if self.context_length is not None and len(prompt_ids) > self.context_length:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens is longer than the model's context of "
                f"{self.context_length} tokens; shorten it"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); check the tokenizer"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"stop token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}): no token can match "
                "them; drop them or check the tokenizer"
            )
        need = len(prompt_ids) + params.max_new_tokens + self.num_draft_slots
        if need > self.kv_capacity_tokens:
            drafts = f" + {self.num_draft_slots} draft slots" if self.num_draft_slots else ""
            raise ValueError(
                f"the request needs up to {need} KV slots (prompt {len(prompt_ids)} + max_new_tokens "
                f"{params.max_new_tokens}{drafts}) but the pool holds {self.kv_capacity_tokens}; lower "
                "max_new_tokens or raise kv_capacity_tokens"
            )

    def steps(self, requests: Sequence[Request]) -> Iterator[tuple[StepPlan, list[Request]]]:
        """Run every unfinished request to completion, yielding each step's plan and finished requests.

        If the loop stops early (an exception, or the consumer closing the generator), running requests
        release their slots and keep the tokens generated so far, finished with an error.
        """
        self.run_start = time.perf_counter()
        self._run_steps = 0
        self.host_ms = dict.fromkeys(HOST_PHASES, 0.0)
        if self.tensor_parallel is not None:
            self.tensor_parallel.sync_rng()
        scheduler = Scheduler(
            self.pool.allocator,
            self.config.max_batch_size,
            self.max_step_tokens,
            self.policy,
            self.config.k,
            self.draft_chain,
            self.adaptive_rounds,
            stagger=self.delayed_verify and self.policy is not None and not self.rounds_ahead,
            unified=self.config.unified_schedule,
            rounds_ahead=self.rounds_ahead,
            offload=self._new_offload_stats(),
            host_capacity_tokens=self.host_kv_capacity_tokens,
            draft_step_budget=self.draft_step_budget,
            budget_by_misses=use_budget_by_misses(self.config.budget_by_misses, self.policy, self.device),
            restore_step_tokens=self.restore_step_tokens,
            host_refusal=None if self.runner.host is None else self.runner.host.refusal,
        )
        for request in requests:
            if request.is_finished:
                continue
            if request.params.max_new_tokens == 0:
                request.finish(FinishReason.LENGTH)
            else:
                scheduler.add(request)
        self.runner.table.reset()
        self.runner.list_bound = max((request.max_total_tokens for request in requests), default=0)
        in_flight: LaunchedStep | None = None  # launched, not yet read back (delayed verification)
        last_commit: float | None = None  # when the last step was read back and applied
        captures = self.runner.num_captures  # graph captures as of the last step applied
        try:
            in_model_dtype = replaced_forwards(self.model_dtype_forwards)
            with routed_attention(self.model), in_model_dtype, self._fused_forwards(), _frozen_heap():
                while scheduler.has_work():
                    started = time.perf_counter()
                    plan = scheduler.schedule(in_flight.plan if in_flight is not None else None)
                    _freeze_started(plan)
                    self.runner.move_kv(plan)
                    scheduled = time.perf_counter()
                    launched = self.runner.launch(plan) if plan.scheduled else None
                    self.host_ms["schedule"] += 1e3 * (scheduled - started)
                    self.host_ms["launch"] += 1e3 * (time.perf_counter() - scheduled)
                    if in_flight is None and launched is None:
                        raise RuntimeError(
                            "scheduler made no progress: a waiting request can never be admitted"
                            + (
                                ", or the host tier is too full to move requests out of the pool: raise "
                                "host_kv_capacity_tokens"
                                if self.config.offload
                                else ""
                            )
                        )
                    if not self.delayed_verify:
                        in_flight, launched = launched, None
                    if in_flight is not None:  # read back while the step just launched runs
                        committed = self._commit(scheduler, in_flight)
                        # A step's cost: a synchronous step's wall time; with steps overlapping, the time since
                        # the last one was applied (in a steady stream, one step finishes per that period).
                        now = time.perf_counter()
                        since = started if launched is None else last_commit
                        # A graph captured since the last step applied (launching this one or the next) is time
                        # no later step pays: a bucket's first round would otherwise read as a dear one.
                        before, captures = captures, self.runner.num_captures
                        if since is not None and captures == before:
                            span, forwards = in_flight.chain_span, in_flight.num_chain_forwards
                            draft_ms = span.ms() / forwards if span is not None else None
                            scheduler.observe_step(in_flight.plan, 1e3 * (now - since), draft_ms)
                        last_commit = now
                        for observer in self.observers:
                            observer(*committed)
                        yield committed
                    in_flight = launched
        finally:
            for request in list(scheduler.running):
                scheduler.finish(request, FinishReason.ERROR)
                request.error = "stopped before finishing"
            for request in scheduler.offloaded:
                request.finish(FinishReason.ERROR, "stopped before finishing (its K/V was on the host)")
                self.runner.host.drop(id(request))
            for request in scheduler.waiting:
                request.finish(FinishReason.ERROR, "stopped before starting")

    def _new_offload_stats(self) -> OffloadStats | None:
        """A run's host-tier counters, shared by the scheduler (what moves) and the store (the copies)."""
        if self.runner.host is None:
            return None
        self.runner.host.stats = OffloadStats()
        return self.runner.host.stats

    def _fused_forwards(self) -> contextlib.AbstractContextManager:
        return self.fused_layers.installed() if self.fused_layers is not None else contextlib.nullcontext()

    def _commit(self, scheduler: Scheduler, step: LaunchedStep) -> tuple[StepPlan, list[Request]]:
        """Read a launched step back and apply it; the finished requests give their slot-table rows back."""
        start = time.perf_counter()
        results = self.runner.collect(step)
        collected = time.perf_counter()
        finished = scheduler.commit(step.plan, results)
        self.host_ms["read-back"] += 1e3 * (collected - start)
        self.host_ms["commit"] += 1e3 * (time.perf_counter() - collected)
        for request in finished:
            self.runner.release(request)
        self._run_steps += 1
        return step.plan, finished

    def run(self, requests: Sequence[Request], on_step: StepCallback | None = None) -> GenerationStats:
        """Run every request to completion (see :meth:`steps`) and return the call's statistics."""
        for plan, finished in self.steps(requests):
            if on_step is not None:
                on_step(plan, finished)
        if self.tensor_parallel is not None:  # ranks that drifted apart would have mixed their partial sums
            self.tensor_parallel.check_same(hash(tuple(tuple(r.token_ids) for r in requests)), "the tokens generated")
        return self.stats_for(requests)

    def stats_for(self, requests: Sequence[Request]) -> GenerationStats:
        """Statistics of the last :meth:`steps` run over ``requests``."""
        spec = [r.spec_stats for r in requests]
        return GenerationStats(
            num_rounds=sum(s.num_rounds for s in spec),
            num_draft_tokens=sum(s.num_draft_tokens for s in spec),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in spec),
            accepted_histogram=accepted_histogram(spec, self.config.k),
            num_requests=len(requests),
            num_failed=sum(r.finish_reason is FinishReason.ERROR for r in requests),
            prompt_tokens=sum(r.num_prompt_tokens for r in requests),
            generated_tokens=sum(r.num_output_tokens for r in requests),
            wall_time_s=time.perf_counter() - self.run_start,
            steps=self._run_steps,
            host_ms=dict(self.host_ms),
            offload=None if self.runner.host is None else self.runner.host.settle(),
        )

    def new_request(self, request_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """A request, checked; a bad one comes back already finished with its error, so others go on."""
        request = Request(request_id=request_id, prompt_ids=list(prompt_ids), params=params)
        try:
            self.check_request(request.prompt_ids, params)
        except ValueError as error:
            request.finish(FinishReason.ERROR, str(error))
        return request
