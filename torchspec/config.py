"""SpecConfig: every knob of a wrapped model in one validated dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attention import BACKENDS
from torchspec.kv_cache import DEFAULT_DEVICE_MEMORY_FRACTION

#: Draft policies (registered in ``torchspec.drafting``); ``None`` decodes without speculation.
DRAFT_POLICIES: tuple[str, ...] = (
    "pillar_recent",
    "pillar",
    "streaming",
    "ngram",
    "quest",
    "sparsespec_l",
    "oracle",
    "pillar_quest",
    "query_sketch",
)
#: The default draft: the best real policy measured on the embedded model (docs/acceptance.md).
DEFAULT_DRAFT = "pillar_recent"


@dataclass(frozen=True)
class SpecConfig:
    """Configuration of a :class:`~torchspec.SparseSpecForCausalLM`.

    Attributes:
        draft: draft policy name (default ``"pillar_recent"``: PillarAttn's Top-K plus a recent window and
            successor expansion, the best real draft measured on SmolLM2), or ``None`` to decode without
            speculation.
        k: draft tokens per speculation round.
        sparsity: fraction of a request's KV cache a sparse draft step attends to.
        min_budget: lower bound on the number of KV tokens a sparse draft step attends to.
        draft_step_budget: KV tokens the draft steps of one step may attend to together: each decoding request
            drafts from at least its share (this over the requests running), on top of ``sparsity``. A draft
            forward of a few requests costs its fixed launch and weight-read time whatever it reads, so as a batch
            drains its drafts read more of their contexts, then all of them, and rounds accept nearly every draft
            (W1: a poorly drafted request left alone accepted 2.3 of 8). ``None`` = 65,536 on a GPU (W1's best:
            256 positions a request at full batch, every position below ~8 requests) and 0 on a CPU, where
            attention costs what it reads at any batch size.
        budget_by_misses: weigh each request's draft budget (``sparsity`` and step share alike) by 1 + the drafts
            its recent rounds rejected, over the batch's mean of the same (at most 3x): the batch reads about what
            even budgets read, the answers whose drafts fall short draft from more of their context and the ones
            whose drafts all pass from less, so the slowest answers do not set the run's end alone. Not with
            ``query_sketch`` (its budgets are bounds of its device lists). ``None`` = on with CUDA for the other
            sparse drafts, off on a CPU. W1 on three H100s: +2.0%, +1.2% and +3.9% (session 34: a drain of 9.6 s
            against 11.6, full-batch rounds 1.1 ms dearer; docs/performance.md).
        num_sinks: first tokens (attention sinks) that streaming-style drafts and ``query_sketch`` always attend to.
        recent_window: latest tokens before the verify that PillarAttn drafts always attend to, on top of
            the tokens written since (0 = the policy's own: none for the paper's ``pillar``, 64 for
            ``pillar_recent``, ``sparsespec_l``, ``pillar_quest`` and ``query_sketch``).
        successors: PillarAttn also takes the next ``successors`` positions after each Top-K pick, within the
            same budget (copy/induction attention moves forward with the query; 0 = the policy's own: none
            for ``pillar`` and ``query_sketch``, 4 for ``pillar_recent``).
        sketch_shortlist: ``query_sketch`` chooses every draft's positions from its own query on the int4 key
            sketch: a round's first draft scores every older position, its later drafts rescore the positions it
            scored best, ``sketch_shortlist`` times as many as they pick (default 8: 7.72 accepted of 8 for ~1.3x a
            ``pillar_recent`` round's reads, docs/acceptance.md; 0: every draft scores every older position, 7.84
            for 1.5-1.8x).
        head_budgets: PillarAttn shares each layer's Top-K picks across its KV heads by one Top-K over all of
            them (most verify mass kept; each head's mass is relative to its own sink) instead of the same number
            per head.
        relearn_rounds: PillarAttn learns its pattern from the verify of one round in every ``relearn_rounds``
            (1: every round, the paper's). The rounds between draft from the last pattern learned plus every
            position written since (its recent run), and their verifies skip PillarAttn's Top-K. Same tokens and
            distribution at any value: only what the drafts attend to changes.
        max_batch_size: most requests decoded together.
        kv_capacity_tokens: KV slots in the pool; ``None`` sizes the pool from free device memory.
        kv_memory_fraction: share of the device memory free after the weights and the step buffers that an
            automatic pool (``kv_capacity_tokens=None``) takes on a GPU: lower it to leave room for a training step
            in the same process (RL rollouts), e.g. 0.3. Memory is read when the model is wrapped.
        max_step_tokens: most query tokens in one forward step (bounds prefill chunks); ``None`` = 2048, or
            a whole batch of verifies (``max_batch_size * (k + 1)``) where that is more, so every request of a
            full batch can verify in the same step.
        offload: admit requests by the KV slots they hold, not their worst case (prompt + ``max_new_tokens``),
            so the running batch is sized by what requests use: each holds its computed positions and room for
            two rounds, topped up as it grows. When a step would not fit, whole requests (the most recently
            admitted first, so the oldest finish first) move their K/V to host memory and come back, before new
            requests are admitted, once slots free up; nothing is ever recomputed (torchspec/kv_offload.py).
            ``False``: every request reserves its worst case at admission and waits until it fits.
        host_kv_capacity_tokens: most K/V rows the host tier holds with ``offload=True``; ``None`` = half of the
            host's available memory. A request that does not fit there stays on the device and the others wait.
            The tier's memory is page-locked as it is first needed (in doubling slabs) and kept for later runs;
            memory the host cannot give counts as no room (the scheduler asks before it sends a request out).
        delayed_verify: launch each step before reading the previous one back, so the host's reading,
            bookkeeping and planning overlap the GPU's work; stop conditions then apply one step late and the
            token made past a stop is discarded (same tokens, same distribution). Without speculation every step
            emits one token per request, and the next step is fed it on the device. With draft chains whose lists
            the runner places (every policy but those choosing inside attention, on models without sliding
            windows) a request's next round launches while its last one is in flight, starting where the device
            knows that round ends (rounds ahead); otherwise the decoding requests alternate in two halves, one
            half's rounds running while the host reads back and plans the other's. ``None`` = on without
            speculation, and on CUDA with rounds ahead: on W1 (H200, 256 requests) rounds ahead ran at 1.10x the
            synchronous loop, the halves at 0.86x (docs/performance.md); elsewhere speculation keeps the
            synchronous loop, reproducible step for step.
        unified_schedule: the paper's unified phase buckets: each request's first round is cut short so that
            the decoding requests' rounds are spread over the k + 1 phases of a round, and every step (one
            forward, one draft token per request) holds about 1 / (k + 1) of them verifying and the rest
            drafting: one steady batch shape instead of k draft forwards and then one verify forward of the whole
            batch. Rounds drafted one forward per step: ``draft_chain=True`` is refused with it, and
            ``draft_chain=None`` turns chains off. ``False`` (the default until it is measured on W1:
            ``bench.throughput --drafts pillar_recent+unified_schedule``): requests keep the phase they reach;
            with draft chains every step runs each decoding request's whole round, all of them in phase.
        compile: ``torch.compile`` the model forward (attention stays one opaque custom op per layer);
            ``None`` = off. An earlier tree measured it at 1.14x (plain) and 1.36x (speculation) on W1, but on
            this tree's first H200 run plain decoding with it took 41.6 ms per step against 12.5 without
            (256 x 1,024 tokens, docs/performance.md): opt-in until that is understood.
        cuda_graphs: replay the forward of decoding steps (drafts, verifies, plain decodes, any mix) from CUDA
            graphs captured per padded (drafts, verifies) bucket, and the later forwards of a round's draft
            chains with their sampling as one graph per forward, bucket and sampling layout
            (torchspec/chain_graphs.py: no sliding windows); on a CPU the same padded static path runs
            without capture (same tokens). ``None`` = on with CUDA (measured on the H200: 2.4x for plain
            decoding, 1.7x with speculation, docs/performance.md), off elsewhere and with the reference
            attention backend (it reads the lists on the host, which a capture cannot hold).
        draft_chain: run each request's whole round within one engine step: its draft forwards back to back,
            each fed the previous draft token on the device, then its verify forward, fed the drafts on the
            device too. The host plans and reads back once per round instead of k + 1 times, and queues the
            round's k + 1 forwards without waiting for the GPU in between; every request runs a round every
            step, so each forward holds the whole batch. Same tokens as one draft per step (greedy) and the
            same distribution (sampling). ``None`` = on, except for policies that decide after each draft
            whether to draft another (``sparsespec_l``: by its entropy, read on the host).
        adaptive_rounds: choose each step's round length (0 to k drafts) for the most tokens per millisecond, from
            each request's recent acceptance and the measured cost of rounds and plain steps at its batch size
            (torchspec/round_length.py): a round where drafts cost about what a plain step does (few requests,
            short context) gives way to plain decoding. Same tokens and distribution at every length. Off by
            default: on W1 (H200) its cost estimates chose plain steps where whole-round graphs made rounds the
            faster choice (the lone last request: 1,406 steps in 5.1 s against 197 rounds in 2.4 s without it).
        fuse_layers: inside an engine run, a Llama-family layer's q/k/v and gate/up projections run as one GEMM
            each, its RMSNorms and SiLU x mul as one kernel each, its rotary embedding inside the kernel that
            stores the new K/V, and each residual add inside the GEMM before it (torchspec/fused_layers.py: 8 ops
            per layer instead of 38). ``None`` = on wherever a module is recognised and a probe forward (when
            the engine is built) matches the model's own logits.
        attention_backend: ``"triton"`` (the fused kernels), ``"reference"`` (plain PyTorch, any device),
            ``"auto"`` (Triton on CUDA, the reference elsewhere) or ``"flex"`` (``"auto"`` with FlexAttention
            for prefill chunks: a document mask built from the slot lists; measured 6.5-7.4x slower than the Triton
            kernel's prefill on the H200, docs/performance.md).
        tensor_parallel_size: shard the attention heads and MLP of each layer over this many ranks of
            torch.distributed (launched by torchrun; torchspec/parallel/): each rank holds its heads' K/V and runs
            the same schedule on the same tokens. 1 = no sharding.
    """

    draft: str | None = DEFAULT_DRAFT
    k: int = 8
    sparsity: float = 0.05
    min_budget: int = 128
    draft_step_budget: int | None = None
    budget_by_misses: bool | None = None
    num_sinks: int = 4
    recent_window: int = 0
    successors: int = 0
    sketch_shortlist: int = 8
    head_budgets: bool = False
    relearn_rounds: int = 1
    max_batch_size: int = 256
    kv_capacity_tokens: int | None = None
    kv_memory_fraction: float = DEFAULT_DEVICE_MEMORY_FRACTION
    max_step_tokens: int | None = None
    offload: bool = False
    host_kv_capacity_tokens: int | None = None
    delayed_verify: bool | None = None
    unified_schedule: bool = False
    compile: bool | None = None
    cuda_graphs: bool | None = None
    draft_chain: bool | None = None
    adaptive_rounds: bool = False
    fuse_layers: bool | None = None
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.draft is not None and self.draft not in DRAFT_POLICIES:
            raise ValueError(f"unknown draft policy {self.draft!r}; choose one of {list(DRAFT_POLICIES)} or None")
        _require(_is_int(self.k) and self.k >= 1, f"k must be an integer >= 1, got {self.k!r}")
        _require(
            isinstance(self.sparsity, (int, float)) and not isinstance(self.sparsity, bool) and 0 < self.sparsity <= 1,
            f"sparsity must be in (0, 1], got {self.sparsity!r}",
        )
        _require(
            _is_int(self.min_budget) and self.min_budget >= 1,
            f"min_budget must be an integer >= 1, got {self.min_budget!r}",
        )
        _require(
            self.draft_step_budget is None or (_is_int(self.draft_step_budget) and self.draft_step_budget >= 0),
            f"draft_step_budget must be None or an integer >= 0, got {self.draft_step_budget!r}",
        )
        _require(
            not (self.budget_by_misses and self.draft == "query_sketch"),
            "budget_by_misses=True cannot run with draft='query_sketch' (its budgets bound its device lists); "
            "use another draft or budget_by_misses=False",
        )
        for name in ("num_sinks", "recent_window", "successors", "sketch_shortlist"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 0, f"{name} must be an integer >= 0, got {value!r}")
        _require(
            _is_int(self.relearn_rounds) and self.relearn_rounds >= 1,
            f"relearn_rounds must be an integer >= 1, got {self.relearn_rounds!r}",
        )
        _require(
            _is_int(self.max_batch_size) and self.max_batch_size >= 1,
            f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}",
        )
        _require(
            self.kv_capacity_tokens is None or (_is_int(self.kv_capacity_tokens) and self.kv_capacity_tokens >= 1),
            f"kv_capacity_tokens must be None or an integer >= 1, got {self.kv_capacity_tokens!r}",
        )
        _require(
            isinstance(self.kv_memory_fraction, (int, float))
            and not isinstance(self.kv_memory_fraction, bool)
            and 0 < self.kv_memory_fraction <= 1,
            f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}",
        )
        _require(
            self.kv_capacity_tokens is None or self.kv_memory_fraction == DEFAULT_DEVICE_MEMORY_FRACTION,
            "kv_memory_fraction sizes an automatic pool: pass kv_capacity_tokens or kv_memory_fraction, not both",
        )
        _require(
            self.max_step_tokens is None or (_is_int(self.max_step_tokens) and self.max_step_tokens >= 1),
            f"max_step_tokens must be None or an integer >= 1, got {self.max_step_tokens!r}",
        )
        _require(
            self.attention_backend in BACKENDS,
            f"attention_backend must be one of {list(BACKENDS)}, got {self.attention_backend!r}",
        )
        _require(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        _require(
            self.tensor_parallel_size == 1 or not self.adaptive_rounds,
            "adaptive_rounds=True chooses round lengths from each rank's own step timings, so tensor-parallel ranks "
            "would schedule differently: use adaptive_rounds=False with tensor_parallel_size > 1",
        )
        for name in ("offload", "unified_schedule", "head_budgets", "adaptive_rounds"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be a bool")
        for name in ("compile", "cuda_graphs", "draft_chain", "delayed_verify", "fuse_layers", "budget_by_misses"):
            _require(getattr(self, name) in (None, True, False), f"{name} must be None, True or False")
        _require(
            self.host_kv_capacity_tokens is None
            or (_is_int(self.host_kv_capacity_tokens) and self.host_kv_capacity_tokens >= 1),
            f"host_kv_capacity_tokens must be None or an integer >= 1, got {self.host_kv_capacity_tokens!r}",
        )
        _require(
            self.offload or self.host_kv_capacity_tokens is None,
            "host_kv_capacity_tokens sizes the host tier of offload=True: pass offload=True or leave it at None",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SpecConfig:
        """Build from ``wrap()``'s keyword arguments, naming any that is not a config field."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown SpecConfig option(s) {unknown}; valid options are {sorted(fields)}")
        return cls(**kwargs)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
