"""``cuda_graphs=True``: one-token steps run through padded, fixed-address buffers (captured and replayed on
CUDA; run directly on the CPU) and give the dynamic path's tokens."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest
import torch

import attention
from tests.conftest import triton_specialization
from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import sparsespec
from torchspec.cuda_graphs import CaptureLog, GraphPool, bucket_sizes, capture_graph, held_bucket
from torchspec.engine import use_cuda_graphs
from torchspec.request import SamplingParams

triton_interpreter = pytest.importorskip("triton.runtime.interpreter")

pytestmark = pytest.mark.usefixtures("single_thread")

# Small prefill chunks: requests finish their prompts at different steps, so their rounds stay out of phase
# and most speculative steps mix drafts and verifies (the unified batch).
OPTIONS = {"kv_capacity_tokens": 512, "k": 4, "min_budget": 6, "max_batch_size": 8, "max_step_tokens": 12}


def test_capture_log_totals_captures_by_kind_and_reason():
    """The benchmark's breakdown of graph captures: bucket sizes and list-length hints dropped, kinds and reasons
    kept apart."""
    log = CaptureLog(
        events=[
            ("step 256+0: new bucket", 0.25),
            ("chain 256: new bucket", 0.5),
            ("step 32+32 (draft lists to 300, full to 8200): new bucket", 0.25),
            ("chain 256 (lists to 4100): draft lists outgrew its buffer", 1.0),
        ]
    )
    assert log.by_reason() == {
        "step: new bucket": [2, 0.5],
        "chain: new bucket": [1, 0.5],
        "chain: draft lists outgrew its buffer": [1, 1.0],
    }


def test_a_capture_names_the_list_lengths_its_launches_were_planned_for(monkeypatch):
    """A capture's label (a throughput record's ``graph_capture_events``) names the bucket, the list lengths its
    attention launches were planned for (their split counts stay fixed in the graph) and why it was made. On a
    CPU a "graph" here runs its forward again at each replay, so the step and chain graphs' capture paths run."""

    class Eager:
        def __init__(self, run) -> None:
            self.replay = run

    monkeypatch.setattr("torchspec.cuda_graphs.capture_graph", lambda run, pool=None: (Eager(run), run()))
    model = tiny_spec("llama", 2).build()
    wrapped = sparsespec.wrap(model, draft="pillar_recent", cuda_graphs=True, **OPTIONS)
    runner = wrapped.engine.runner
    runner.graphs.capture = runner.chain_graphs.capture = True
    wrapped.generate(**Batch((12, 20)).kwargs(), max_new_tokens=24, do_sample=False)
    labels = [label for label, _ in runner.graphs.captures.events]
    step, chain = r"step \d+\+\d+ \((draft lists to \d+, )?full to \d+\): \w.*", r"chain \d+ \(lists to \d+\): \w.*"
    assert labels and all(re.fullmatch(step, label) or re.fullmatch(chain, label) for label in labels), labels
    assert any(label.startswith("chain") for label in labels) and any("draft lists to" in label for label in labels)


def test_bucket_sizes_cover_every_batch_once():
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 32, *range(64, 256, 32), 256]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(1) == [1]
    for maximum in (1, 5, 33, 100):
        sizes = bucket_sizes(maximum)
        assert sizes == sorted(set(sizes)) and sizes[-1] == maximum


SIZES = bucket_sizes(256)


def test_a_step_replays_a_bucket_made_within_twice_its_own_or_a_small_one():
    made = [(0, 256), (256, 0), (256, 64), (160, 4)]  # counts below are bucket sizes: each its own bucket
    assert held_bucket((224, 0), SIZES, made) == (256, 0)
    assert held_bucket((96, 0), SIZES, made) == (96, 0), "pads more than twice its requests"
    assert held_bucket((128, 2), SIZES, made) == (160, 4), "not the smallest that holds it"
    assert held_bucket((224, 1), SIZES, made) == (224, 1), "64 verifies pad more than twice its one and past 32"
    assert held_bucket((0, 160), SIZES, made) == (0, 256)
    assert held_bucket((4, 256), SIZES, made) == (4, 256), "a bucket without drafts holds no step with drafts"
    assert held_bucket((8,), SIZES, [(16,), (32,)]) == (16,)
    # Up to SMALL_BUCKET (32) requests a dimension, a step pads to any bucket made there: its forward costs the same.
    assert held_bucket((1,), SIZES, [(32,)]) == (32,)
    assert held_bucket((2, 0), SIZES, [(32, 0), (64, 0)]) == (32, 0), "not past 32, nor twice its own"
    assert held_bucket((130, 1), SIZES, [(160, 4)]) == (160, 4)
    assert held_bucket((1,), SIZES, [(64,)]) == (1,), "64 is past 32 and past twice its own"


def test_a_draining_batch_replays_the_buckets_it_made():
    """Eight requests finishing one after another pass through buckets of 8, 4, 2 and 1 verifies: every step
    replays the bucket of 8 (at most ``SMALL_BUCKET`` requests: a GPU captures one graph, not four), where its
    attention reads how many of them are real (the last step: one), and the tokens are the dynamic path's."""
    spec, batch = tiny_spec("llama", 2), Batch((5, 9, 4, 7, 6, 8, 3, 10), seed=2)
    model = spec.build()
    options = {"kv_capacity_tokens": 512, "max_batch_size": 8}
    prompts, lengths = batch.prompts, list(range(3, 11))  # request i stops after 3 + i tokens

    def run(cuda_graphs: bool):
        engine = sparsespec.wrap(model, draft=None, cuda_graphs=cuda_graphs, **options).engine
        requests = [
            engine.new_request(i, prompt, SamplingParams(n, n, do_sample=False))
            for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        for _ in engine.steps(requests):
            pass
        return engine, [request.token_ids for request in requests]

    engine, tokens = run(cuda_graphs=True)
    assert {key[:2] for key in engine.runner.graphs._steps} == {(0, 8)}  # (key[2]: the plain batch's layout)
    (step,) = engine.runner.graphs._steps.values()
    assert step.metadata.live_requests is step.live.tensor and step.live.tensor.tolist() == [0, 1]
    assert tokens == run(cuda_graphs=False)[1]


def test_default_captures_on_cuda_only_with_a_capturable_backend():
    """``cuda_graphs=None`` captures on CUDA unless the backend is the reference (its host reads cannot be
    captured: asking for it explicitly is an error that names the fix); on a CPU every setting stays as given."""
    cuda, cpu, kernels = torch.device("cuda"), torch.device("cpu"), object()
    assert use_cuda_graphs(None, cuda, kernels) is True
    assert use_cuda_graphs(None, cuda, attention.reference) is False
    assert use_cuda_graphs(False, cuda, kernels) is False
    assert use_cuda_graphs(None, cpu, kernels) is False
    assert use_cuda_graphs(True, cpu, attention.reference) is True
    with pytest.raises(ValueError, match="attention_backend='auto'"):
        use_cuda_graphs(True, cuda, attention.reference)


@pytest.mark.parametrize("draft", [None, "pillar_recent", "streaming", "query_sketch"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_static_steps_give_the_dynamic_tokens(arch, draft):
    """Greedy generation with the static path equals plain dynamic decoding token for token, for plain
    decoding and sparse drafts (query_sketch's chosen in the forward, on the device): 3 decoding requests pad to a
    bucket of 4 (padding writes the scratch slot, reads nothing), and speculative steps mixing drafts and verifies
    (PillarAttn's verify scores included) really ran through the buckets, their verify mass in one storage that
    the buckets share, and so are their logits (a later call's larger bucket's too).

    Protects the padding and buffer refresh of cuda_graphs.py: a stale slot list or query offset, a padding
    request that reads or writes a real slot, a verify score read at the wrong entry, or a wrong row of
    logits changes the tokens."""
    spec, batch = tiny_spec(arch, 2), Batch((9, 30, 17), seed=3)
    expected = sparsespec.wrap(spec.build(), draft=None, **OPTIONS).generate(
        **batch.kwargs(), max_new_tokens=24, do_sample=False
    )
    wrapped = sparsespec.wrap(spec.build(), draft=draft, cuda_graphs=True, **OPTIONS)
    actual = wrapped.generate(**batch.kwargs(), max_new_tokens=24, do_sample=False)
    assert torch.equal(expected, actual)
    runner = wrapped.engine.runner
    # (padded drafts, padded verifies, the layout of a plain step's selection in the graph or None)
    buckets = set(runner.graphs._steps)
    if draft is None:
        assert (0, 4, (True, False, 0, 1)) in buckets and all(drafts == 0 for drafts, _, _ in buckets), buckets
        assert runner.chain_graphs is None
    else:
        assert any(drafts and verifies for drafts, verifies, _ in buckets), buckets
        assert runner.chain_graphs._steps, "no draft chain ran through the chain graph"
    # Every bucket's verify mass is a view of one storage (a buffer per bucket ran W3 out of memory).
    masses = [step.metadata.mass for step in runner.graphs._steps.values() if step.metadata.mass is not None]
    storages = {mass.untyped_storage().data_ptr() for mass in masses}
    assert len(storages) == (1 if draft == "pillar_recent" else 0), storages
    # So are their logits (a graph keeping its own ran an H100's W3 with offload out of memory), a larger batch's
    # bucket's too.
    wrapped.generate(**Batch((5, 7, 3, 6, 4, 8), seed=4).kwargs(), max_new_tokens=6, do_sample=False)
    buckets = set(runner.graphs._steps)
    logits = {step.logits.untyped_storage().data_ptr() for step in runner.graphs._steps.values()}
    assert len(logits) == 1 and len(buckets) > 1, (logits, buckets)


@pytest.mark.parametrize("sampling", [{"do_sample": False}, {"do_sample": True, "top_k": 5, "top_p": 0.9}])
def test_a_chain_graph_runs_the_forwards_its_round_has(monkeypatch, sampling):
    """The chain graph runs forward j of a round only when its longest chain has one: a short round runs
    fewer forwards, not all k - 1 (a graph holding every forward cost short rounds a full one's time), and
    each run reads the next forward from the device counter, starting at 1. Greedy and top-k/top-p sampled
    rounds both run through it (each sampling layout has its own graph)."""
    spec, batch = tiny_spec("llama", 2), Batch((9, 30, 17), seed=3)
    wrapped = sparsespec.wrap(spec.build(), draft="pillar_recent", cuda_graphs=True, **OPTIONS)
    runner = wrapped.engine.runner
    forwards, steps = [], []
    run, launch = runner.chain_graphs._run, runner.launch

    def count_forwards(step, sampler):
        forwards.append(int(step.forward))
        return run(step, sampler)

    def record(plan):
        before = len(forwards)
        launched = launch(plan)
        steps.append((plan.round_length, forwards[before:]))
        return launched

    monkeypatch.setattr(runner.chain_graphs, "_run", count_forwards)
    monkeypatch.setattr(runner, "launch", record)
    torch.manual_seed(0)
    wrapped.generate(**batch.kwargs(), max_new_tokens=23, **sampling)
    rounds = [(length, ran) for length, ran in steps if length > 1]
    assert rounds and all(ran == list(range(1, length)) for length, ran in rounds), steps
    assert any(length < OPTIONS["k"] for length, _ in rounds), f"no short round ran: {steps}"
    layouts = {layout for step in runner.chain_graphs._steps.values() for layout in step.samplers}
    assert len(layouts) == 1 and next(iter(layouts))[0] is (not sampling["do_sample"]), layouts


@pytest.mark.parametrize(
    "sampling",
    [{"do_sample": False}, {"do_sample": True, "temperature": 0.8, "min_p": 0.05}],
    ids=["greedy", "sampled"],
)
def test_a_chain_graph_capture_leaves_the_round_as_it_found_it(monkeypatch, sampling):
    """Capturing a chain graph runs its forward once outside the graph (the warm-up), which draws tokens, adds
    them to the round's repetition-penalty token sets and advances the forward counter: the round must start
    over after it, or its forward would penalise a draw it has not made (greedy: its own argmax). Modelled on
    the CPU (a capture that runs the forward once, a graph that runs it on each replay): with drafts reading
    every position, each draft is its verify's choice and is accepted."""

    def capture(run, label, pool):
        run()
        return SimpleNamespace(replay=run), None

    batch = Batch((9, 30, 17, 5, 40, 12, 21, 3), seed=3)
    wrapped = sparsespec.wrap(
        tiny_spec("llama", 2).build(), draft="pillar_recent", cuda_graphs=True, **(OPTIONS | {"min_budget": 256})
    )
    chain_graphs = wrapped.engine.runner.chain_graphs
    monkeypatch.setattr(chain_graphs, "capture", True)
    monkeypatch.setattr(chain_graphs.captures, "capture", capture)
    torch.manual_seed(0)
    wrapped.generate(**batch.kwargs(), max_new_tokens=23, repetition_penalty=3.0, **sampling)
    stats = wrapped.last_stats
    samplers = [sampler for step in chain_graphs._steps.values() for sampler in step.samplers.values()]
    assert samplers and all(sampler.graph is not None for sampler in samplers)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_pool_outlives_the_graphs_captured_into_it():
    """Graphs sharing a pool may all be dropped (a bucket re-captured) while tensors they made stay in it: the next
    capture into the pool works. With a bare ``torch.cuda.graph_pool_handle()`` the second capture raised
    "use_count > 0 INTERNAL ASSERT FAILED" (query_sketch on an H100)."""
    device = torch.device("cuda")
    pool, counter, outputs = GraphPool(device), torch.zeros(1, device=device), []
    for _ in range(2):
        graph, output = capture_graph(lambda: counter.add_(1) * 2, pool.handle)  # its output is the pool's
        graph.replay()
        outputs.append(output)
        del graph
    torch.cuda.synchronize()
    assert counter.item() == 4 and outputs[-1].item() == 8  # each capture's warm-up run, then its replay


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("draft", [None, "pillar_recent", "query_sketch"])
def test_captured_graphs_replay_the_eager_tokens_on_cuda(draft, penalty):
    """On the GPU the buckets are captured as CUDA graphs and replayed: fp32 greedy tokens equal the eager
    dynamic path's, with a repetition penalty too."""
    spec, batch = tiny_spec("llama", 2), Batch((9, 30, 17, 5, 40), seed=4)
    options = {**OPTIONS, "attention_backend": "triton"}
    model = spec.build().cuda()
    inputs = {name: value.cuda() for name, value in batch.kwargs().items()} | {"repetition_penalty": penalty}
    eager = sparsespec.wrap(model, draft=draft, cuda_graphs=False, **options)  # (on CUDA graphs are the default)
    expected = eager.generate(**inputs, max_new_tokens=40, do_sample=False)
    wrapped = sparsespec.wrap(model, draft=draft, cuda_graphs=True, **options)
    actual = wrapped.generate(**inputs, max_new_tokens=40, do_sample=False)
    assert torch.equal(expected, actual)
    runner = wrapped.engine.runner
    assert runner.graphs.num_captured > 0
    if draft is not None:  # the chains' later forwards replayed from their own graph
        samplers = [sampler for step in runner.chain_graphs._steps.values() for sampler in step.samplers.values()]
        assert any(sampler.graph is not None for sampler in samplers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("penalised", [False, True], ids=["plain", "penalty-min_p"])
@pytest.mark.parametrize(
    ("draft", "delayed_verify"),
    [(None, None), ("pillar_recent", False), ("pillar_recent", True), ("query_sketch", True)],
)
def test_steady_steps_synchronise_at_most_once(draft, delayed_verify, penalised):
    """Once its buckets are captured, a decoding step waits for the GPU at most once: its read-back. Planning,
    launching and committing never copy from pageable memory, read a device value (``.item()``, ``.tolist()``)
    or make a data-dependent shape; sync debug mode ('warn') flags each such wait, counted per step. With
    delayed verification and speculation each step holds every request's round, launched while its last round
    is in flight (rounds ahead), or, for a policy choosing inside attention (no rounds ahead), the rounds of half
    the requests while the other half's are in flight. A repetition penalty's token sets and min_p stay on the
    device too."""
    model = tiny_spec("llama", 2).build().cuda()
    wrapped = sparsespec.wrap(
        model, draft=draft, delayed_verify=delayed_verify, kv_capacity_tokens=4096, k=4, min_budget=6
    )
    engine = wrapped.engine
    extra = {"repetition_penalty": 1.3, "min_p": 0.05} if penalised else {}
    params = SamplingParams(max_new_tokens=80, min_new_tokens=80, do_sample=True, temperature=0.7, **extra)
    requests = [engine.new_request(i, list(range(3, 3 + n)), params) for i, n in enumerate((20, 31, 25, 40))]
    steps = iter(engine.steps(requests))
    for _ in range(6):  # prompts, the first plain steps and rounds: every bucket of this batch captured
        next(steps)
    staggered = engine.delayed_verify and draft is not None and not engine.rounds_ahead
    steady = len(requests) // 2 if staggered else len(requests)
    per_step = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(6):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plan, _ = next(steps)
            assert len(plan.scheduled) == steady, "a request finished or waited: not a steady step"
            per_step.append([str(w.message) for w in caught if "synchroniz" in str(w.message)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(syncs) <= 1 for syncs in per_step), per_step


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts launches in Triton's CPU interpreter")
@pytest.mark.parametrize("draft", ["pillar_recent", "query_sketch"])
@pytest.mark.usefixtures("small_wave")
def test_a_shrinking_batch_compiles_each_kernel_once(monkeypatch, draft):
    """Sampled speculation (its chains in the chain graph) while a batch drains through its buckets: every
    launch of a kernel with the same constexprs has one specialization key, so a GPU compiles it once. W1 on an H200
    compiled the attention kernel again mid-run (1-4 s each) because a chain graph's per-forward list
    offsets are rows of one ``[forwards, D' + 1]`` buffer, 16-byte aligned on every other forward. query_sketch's
    kernels (scoring, Top-K, lists) read widths that grow over the generation: one variant each too."""
    keys: dict[tuple, set[tuple]] = {}
    launch = triton_interpreter.InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        constexprs, key = triton_specialization(self, args, kwargs)
        keys.setdefault(constexprs, set()).add(key)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(triton_interpreter.InterpretedFunction, "run", recorded)
    spec = tiny_spec("llama", 2)
    engine = sparsespec.wrap(spec.build(), draft=draft, cuda_graphs=True, attention_backend="triton", **OPTIONS).engine
    generator = torch.Generator().manual_seed(5)
    requests = []
    for index, new_tokens in enumerate((3, 6, 9, 12)):  # finishing one after another
        prompt = torch.randint(3, spec.config().vocab_size, (12 + index,), generator=generator).tolist()
        params = SamplingParams(new_tokens, new_tokens, do_sample=True, temperature=0.7)
        requests.append(engine.new_request(index, prompt, params))
    for _ in engine.steps(requests):
        pass
    assert [request.num_output_tokens for request in requests] == [3, 6, 9, 12]
    assert any(constexprs[0] == "_attention_kernel" for constexprs in keys)
    if draft == "query_sketch":
        assert {"_sketch_mass_kernel", "_sketch_lists_kernel"} <= {constexprs[0] for constexprs in keys}
    varying = {  # kernel -> the arguments whose specialization differs between its launches
        constexprs[0]: sorted(
            {entry[0] for key in found for entry in key if sum(entry in k for k in found) < len(found)}
        )
        for constexprs, found in keys.items()
        if len(found) > 1
    }
    assert not varying, varying
