"""The end-to-end throughput benchmark generates exactly the requested tokens and reports what ran."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from PIL import Image

from benchmarks import decode_step, drain_report, host_paced, host_split, host_step, plot_timeline, step_profile
from tests.torchspec.conftest import tiny_spec
from torchspec import sparsespec
from torchspec.bench import gpu_time
from torchspec.bench.records import parse_setting
from torchspec.bench.throughput import (
    HOST_TRACE_FIELDS,
    REQUEST_FIELDS,
    TRACE_FIELDS,
    StepTimeline,
    allocator_calls_since,
    allocator_counters,
    device_memory_gib,
    main,
    measure,
    trace_steps,
)
from torchspec.engine import HOST_PHASES
from torchspec.kv_cache import bytes_per_token
from torchspec.workloads import read_prompts

pytestmark = pytest.mark.slow


def test_throughput_record_counts_the_real_work(smollm2):
    """Two prompts x 12 tokens on the embedded model (CPU): every request gets all 12 tokens (EOS held back),
    and the record's counts agree with the engine's (a warm-up run's excluded); speculation reports rounds,
    plain decoding none."""
    model, tokenizer = smollm2
    prompts = [tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Name a prime.")["input_ids"]]
    plain = measure(model, prompts, None, max_new_tokens=12, temperature=0.65)
    assert plain["generated_tokens"] == 24 and plain["tokens_per_s"] > 0 and plain["mean_accepted"] == 0
    assert plain["steps"] >= 12  # a prefill step, then one decode step per token
    speculative = measure(model, prompts, "pillar_recent", max_new_tokens=12, temperature=0.0, warmup_tokens=3)
    assert speculative["generated_tokens"] == 24 and speculative["mean_accepted"] > 0
    assert plain["warmup_s"] == 0 < speculative["warmup_s"]  # the warm-up's steps are not in the record (below)
    p50, p90, slowest = speculative["latency_s_p50_p90_max"]
    assert 0 < p50 <= p90 <= slowest <= speculative["seconds"]
    low, mid, high = speculative["request_accepted_p10_p50_p90"]
    assert 0 <= low <= mid <= high <= 8 and high > 0
    second, last = speculative["slowest_requests"]
    assert second["latency_s"] <= last["latency_s"] == slowest and last["rounds"] > 0
    # Where the time went: every step, by batch size (two requests, then one left), rounds among them.
    for record in (plain, speculative):
        groups = record["steps_by_batch"]
        assert sum(g["steps"] for g in groups) == record["steps"]
        assert [g["batch_from"] for g in groups] == sorted({g["batch_from"] for g in groups}, reverse=True)
        assert {g["batch_from"] for g in groups} <= {1, 2}
        steps_s = sum(g["seconds"] for g in groups)  # a step's seconds summed in another order: 1e-9 of slack
        assert 0 < record["first_20_steps_s"] <= steps_s + 1e-9 and steps_s <= record["seconds"]
        for phase in HOST_PHASES:  # the host's ms a step in each phase by batch size: within the run's totals
            by_group = sum(g["host_ms_per_step"][phase] * g["steps"] for g in groups)
            assert 0 <= by_group <= record["host_ms_per_step"][phase] * record["steps"] + 1e-6
        assert all(g["host_ms_per_step"]["launch"] > 0 for g in groups)
    assert sum(g["round_steps"] for g in plain["steps_by_batch"]) == 0
    assert sum(g["round_steps"] for g in speculative["steps_by_batch"]) > 0


def test_decode_step_record_times_full_batch_decode_steps():
    """The decode-step benchmark on a tiny model (CPU, through the padded static path): it times the asked
    number of steps, each with every request decoding at the given context, and its roofline counts the
    weights and the K/V those steps read."""
    spec = tiny_spec("llama", 2)
    model = spec.build()
    record = decode_step.measure(model, batch=3, context=40, steps=4, cuda_graphs=True)
    assert record["steps_timed"] == 4 and record["step_ms"] > 0 and record["host_ms"] > 0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert record["weight_gb"] * 1e9 == weights
    per_token = bytes_per_token(sparsespec.wrap(model).layers, torch.float32)
    # contexts at the timed steps: 41-48 positions per request (prompt 40, a few tokens decoded meanwhile)
    assert 3 * 41 * per_token <= record["kv_gb"] * 1e9 <= 3 * 48 * per_token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles a captured CUDA graph")
def test_decode_step_profile_attributes_the_replay_to_kernel_kinds(tmp_path):
    """``--profile``: the replayed step's GPU time per kernel kind, the attention kernel among them (GPU only)."""
    model = tiny_spec("llama", 2).build().cuda()
    path = tmp_path / "profile.md"
    decode_step.measure(model, batch=3, context=40, steps=4, profile=str(path), cuda_graphs=True)
    text = path.read_text()
    assert text.startswith("GPU time per replay:") and "| attention | " in text and "| matmul | " in text


def test_kernel_kinds_name_the_step_s_kernels():
    """Kernel names map to what they do (the profile's grouping), with an explicit bucket for the rest."""
    assert gpu_time.kernel_kind("_attention_kernel") == "attention"
    assert gpu_time.kernel_kind("_merge_splits_kernel") == "attention split merge"
    assert gpu_time.kernel_kind("at::native::index_elementwise_kernel<index_copy_kernel_impl>") == "K/V store"
    assert gpu_time.kernel_kind("nvjet_sm90_tst_64x8_64x16_1x4_h_bz_TNT") == "matmul"
    assert gpu_time.kernel_kind("triton_poi_fused__unsafe_view_mul_silu_5") == "fused elementwise (compiled)"
    assert gpu_time.kernel_kind("void at::native::reduce_kernel<512>") == "other elementwise / reduction"


def test_host_step_times_decoding_steps_without_a_forward():
    """The host-time benchmark runs full-batch decoding steps with the forward replaced (plain and
    speculative), alternately timed and op-counted, and reports positive medians; speculation really drafted."""
    plain = host_step.measure(batch=4, prompt_len=20, new_tokens=20, draft=None, temperature=0.65)
    assert plain["steps_timed"] >= 8 and plain["host_ms_per_step"] > 0 and plain["mean_accepted"] == 0
    assert plain["ops_per_step"] > 0 and plain["own_ms_per_step"] == {}
    profiled = host_step.measure(batch=4, prompt_len=20, new_tokens=20, draft=None, temperature=0.65, profile_top=5)
    own = profiled["own_ms_per_step"]  # a quarter of the steps profiled: the engine's functions, most own time first
    assert profiled["profiled_steps"] > 0 and 0 < len(own) <= 5 and list(own.values()) == sorted(own.values())[::-1]
    assert all(".py:" in name for name in own) and any(name.startswith("runner.py:") for name in own), own
    # Python calls per profiled step (cProfile's count): only where steps were profiled; at batch 4 a plain step makes
    # ~700 (the engine's functions among them).
    assert plain["python_calls_per_step"] is None and profiled["python_calls_per_step"] > len(own)
    speculative = host_step.measure(batch=4, prompt_len=20, new_tokens=20, draft="pillar_recent", temperature=0.0)
    assert speculative["steps_timed"] >= 8 and speculative["host_ms_per_step"] > 0
    assert speculative["ops_per_step"] > 0
    assert speculative["rounds"] > 0 and plain["rounds"] == 0
    parts = speculative["ops_by_part"]  # a round selects tokens, builds draft lists and learns from its verify
    assert {"token selection", "step metadata", "draft lists", "verify learning", "graph inputs"} <= set(parts)
    sites = speculative["ops_by_site"]  # engine lines, most ops first; none in the replays' stand-ins
    assert any(site.startswith("runner.py:") for site in sites) and list(sites.values()) == sorted(sites.values())[::-1]
    assert parts["chain replay (stand-in)"] > 0  # the chain's later forwards ran from the chain graph
    host_parts = sum(n for part, n in parts.items() if "replay" not in part)
    assert abs(host_parts - speculative["ops_per_step"]) < 0.5 * speculative["ops_per_step"]


def test_host_split_clocks_each_timed_function_while_on():
    """``benchmarks/host_split.py``: every function it times exists (a renamed one would end a GPU session's script
    before it measured anything), and a clock counts a call's inclusive time only while on, a nested call in both."""
    assert all(callable(getattr(owner, name)) for owner, name in host_split.TIMED)

    class Work:
        def outer(self) -> int:
            return self.inner() + 1

        def inner(self) -> int:
            return 1

    clocks = host_split.Clocks()
    clocks.wrap(Work, "outer")
    clocks.wrap(Work, "inner")
    Work().outer()
    assert not clocks.calls
    clocks.on = True
    assert Work().outer() == 2
    assert clocks.calls == {"Work.outer": 1, "Work.inner": 1}
    assert clocks.seconds["Work.outer"] >= clocks.seconds["Work.inner"] > 0


def test_step_profile_times_and_profiles_speculative_steps():
    """The step profiler runs on a CPU at a tiny shape, sampling with top-k: timed steps with their phases
    (each a whole round: the drafts, verified in the same step), the host's time per step in each phase of the
    engine loop (as the engine times them, within the steps' wall time), and a profiler table of the steps after
    them."""
    tiny = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    tiny |= {"num_attention_heads": 4, "num_key_value_heads": 2}
    model = step_profile.random_model(torch.device("cpu"), torch.float32, **tiny)
    prompts = step_profile.random_prompts(512, batch=4, prompt_len=16)
    timed, host, table = step_profile.profile_steps(
        model, prompts, warmup_steps=4, timed_steps=6, profile_steps=2, top_k=8
    )
    assert len(timed) == 6 and all(ms > 0 for ms, _ in timed)
    assert all(phases == ["draft"] for _, phases in timed), timed
    assert set(host) == set(HOST_PHASES) and all(ms > 0 for ms in host.values())
    assert sum(host.values()) <= sum(ms for ms, _ in timed) / len(timed)
    assert table.startswith("2 steps, wall") and "aten::" in table


def test_launch_segments_split_the_gpu_timeline_at_graph_replays():
    """Kernels of one replay form one segment, kernels launched one by one between replays another; spans,
    busy times and counts come from the kernels' own times (us in the trace, ms in the segments)."""
    events = [
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"correlation": 3}},
        {"cat": "kernel", "name": "index", "ts": 1000, "dur": 100, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "gemm", "ts": 3000, "dur": 500, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "attention", "ts": 3500, "dur": 1500, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "topk", "ts": 9000, "dur": 200, "args": {"correlation": 3}},
    ]
    first, replay, last = step_profile.launch_segments(events)
    assert (first["kind"], replay["kind"], last["kind"]) == ("launched kernels", "graph replay", "launched kernels")
    assert (replay["start_ms"], replay["span_ms"], replay["busy_ms"], replay["kernels"]) == (2.0, 2.0, 2.0, 2)
    assert replay["top"] == ["attention", "gemm"]
    assert (last["start_ms"], last["busy_ms"], last["kernels"]) == (8.0, 0.2, 1)
    assert "graph replay | 2.00 | 2.00 | 2.00 | 2 | attention, gemm" in step_profile.format_segments([replay])


def test_a_run_names_its_draft_and_switches_so_one_command_runs_an_ablation(capsys):
    assert parse_setting("pillar_recent+compile-adaptive_rounds") == (
        "pillar_recent",
        {"compile": True, "adaptive_rounds": False},
    )
    assert parse_setting("none") == (None, {})
    assert parse_setting("pillar_recent+relearn_rounds=2+compile+draft_step_budget=0") == (
        "pillar_recent",
        {"relearn_rounds": 2, "compile": True, "draft_step_budget": 0},
    )
    assert parse_setting("query_sketch+k=4+sparsity=0.1+sketch_shortlist=4") == (
        "query_sketch",
        {"k": 4, "sparsity": 0.1, "sketch_shortlist": 4},
    )
    assert parse_setting("pillar_recent+min_budget=64+recent_window=32+successors=2") == (
        "pillar_recent",
        {"min_budget": 64, "recent_window": 32, "successors": 2},
    )
    for bad, named in (
        ("pilar", "unknown draft 'pilar'"),
        ("none+compil", "unknown switch 'compil'"),
        ("pillar_recent+relearn_rounds=two", "bad option '+relearn_rounds=two'"),
        ("pillar_recent+k=2.5", "bad option '+k=2.5'"),
        ("pillar_recent+temperature=1", "bad option '+temperature=1'"),
        ("pillar_recent+sparsity=2", "sparsity must be in (0, 1], got 2.0 (in 'pillar_recent+sparsity=2')"),
        ("pillar_recent+k=0", "k must be an integer >= 1, got 0"),
    ):
        with pytest.raises(SystemExit):
            main(["--drafts", "none", bad])
        assert named in capsys.readouterr().err


def test_throughput_record_reports_the_host_tier_and_natural_lengths(smollm2):
    """``offload=True`` runs put the host tier's counters in the record (None without it); with natural lengths
    a request may stop at EOS before the limit, never past it."""
    model, tokenizer = smollm2
    prompts = [tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Name a prime.")["input_ids"]]
    record = measure(model, prompts, None, max_new_tokens=12, temperature=0.0, natural_lengths=True, offload=True)
    assert record["natural_lengths"] is True and record["generated_tokens"] <= 24
    assert record["offload"]["recomputed_tokens"] == 0 and record["offload"]["peak_device_tokens"] > 0
    plain = measure(model, prompts, None, max_new_tokens=2, temperature=0.0)
    assert plain["offload"] is None and plain["copy_overlap"] is None


def test_a_run_stopped_at_its_time_limit_records_what_it_made():
    """A run past ``time_limit_s`` (0: after its first applied step) stops and is recorded as it stood: not
    completed, its steps, tokens and rate, the host tier's counters and the time line, none of the fields read
    from each request's output (they never returned); the next run in the process completes."""
    model = tiny_spec("llama", 2).build()
    prompts = [list(range(3, 3 + n)) for n in (30, 41, 25, 36)]
    options = {"offload": True, "kv_capacity_tokens": 160, "max_batch_size": 4}
    stopped = measure(model, prompts, "pillar_recent", 40, 0.0, time_limit_s=0.0, **options)
    assert stopped["completed"] is False and stopped["time_limit_s"] == 0.0 and stopped["steps"] == 1
    assert len(stopped["timeline"]["seconds"]) == 1 and stopped["offload"]["recomputed_tokens"] == 0
    assert 0 < stopped["generated_tokens"] <= len(prompts) and stopped["tokens_per_s"] > 0
    assert all(stopped[name] is None for name in REQUEST_FIELDS)
    finished = measure(model, prompts, "pillar_recent", 40, 0.0, time_limit_s=600.0, **options)
    assert finished["completed"] is True and finished["generated_tokens"] == 4 * 40
    assert finished["steps"] > stopped["steps"] and finished["acceptance_by_context"]


def test_packaged_prompts_cycle_past_their_count():
    """W3's 1,024 requests: the 705 packaged prompts, then the first 319 again."""
    prompts = read_prompts()
    cycled = read_prompts(limit=len(prompts) + 3)
    assert cycled[: len(prompts)] == prompts and cycled[len(prompts) :] == prompts[:3]
    assert read_prompts(limit=2) == prompts[:2]


def test_device_memory_is_read_as_a_pool_would_find_it(monkeypatch):
    """Before an engine sizes its pool, a record notes the device's memory after a gc and an emptied allocator
    cache: free by the driver, held by live tensors, cached all the same (an earlier engine's leftovers show
    here). Nothing on a CPU."""
    gib = 1 << 30
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 65 * gib)
    memory = device_memory_gib(torch.device("cuda", 0))
    assert memory == {"free": 70.0, "total": 140.0, "allocated": 5.0, "cached": 60.0} and calls == ["emptied"]
    assert device_memory_gib(torch.device("cpu")) is None


def test_a_record_counts_the_allocator_s_driver_calls_over_its_run(monkeypatch):
    """The caching allocator's cudaMalloc, cudaFree, retries and all-stream syncs, as they grew between two reads
    (a counter the allocator has not started yet reads 0); nothing on a CPU."""
    counts = iter([{"num_device_alloc": 4, "num_device_free": 1}, {"num_device_alloc": 21, "num_device_free": 4}])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: next(counts))
    cuda = torch.device("cuda", 0)
    before = allocator_counters(cuda)
    calls = allocator_calls_since(before, cuda)
    assert calls == {"num_device_alloc": 17, "num_device_free": 3, "num_alloc_retries": 0, "num_sync_all_streams": 0}
    cpu = torch.device("cpu")
    assert allocator_counters(cpu) is None and allocator_calls_since(None, cpu) is None


def test_host_paced_sets_a_runs_wall_time_against_its_gpu_work(tmp_path, capsys):
    """``benchmarks/host_paced.py``: a run of 3,000 steps taking 5 ms a step, then 6 from step 1,000 on, against a
    GPU profiled busy 2 ms a step at step 500 and 6 at step 2,500 (so 2 + (step - 500) / 500 ms anywhere; the same
    report's windows of another draft left out): the GPU's work by ranges of steps, the wall time above it, and
    what the run would make at its GPU's pace."""
    steps = 3000
    wall = [0.1]  # the first step ends 0.1 s in
    indices = trace_steps(steps)
    for first, last in itertools.pairwise(indices):
        wall.append(wall[-1] + sum(5e-3 if step < 1000 else 6e-3 for step in range(first, last)))
    record = {"setting": "none", "steps": steps, "generated_tokens": 256 * steps, "tokens_per_s": 1.0}
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(record | {"timeline": {"seconds": wall}}) + "\n")
    profile = tmp_path / "profile.txt"
    profile.write_text(
        "== none {} window at step 2500: batch 256\nWINDOW steps=8 gpu_busy_ms_per_step=6.00 x=1\n"
        "== none {} window at step 500: batch 256\nWINDOW steps=8 gpu_busy_ms_per_step=2.00 x=1\n"
        "== pillar_recent {} window at step 1500: batch 256\nWINDOW steps=8 gpu_busy_ms_per_step=30.00 x=1\n"
    )
    host_paced.main([str(records), "none", str(profile)])
    lines = capsys.readouterr().out.splitlines()
    # GPU: steps 0-999 sum 2 + (s - 500) / 500 ms = 1.999 s, 1000-1999 3.999, 2000-2998 (the trace ends there) 5.992
    assert lines[:3] == [
        "steps 0-999: wall 5.0 s, GPU 2.0 s",
        "steps 1000-1999: wall 6.0 s, GPU 4.0 s",
        "steps 2000-2999: wall 6.0 s, GPU 6.0 s",
    ]
    assert lines[3] == "all: wall 17.0 s, GPU 12.0 s; wall above the GPU's work 5.0 s"
    assert lines[4] == f"if GPU-bound: {256 * steps / (0.1 + 11.990):,.0f} tok/s (the run: 1)"
    with pytest.raises(SystemExit, match="no record of pillar_recent"):
        host_paced.main([str(records), "pillar_recent", str(profile)])


def test_the_drain_report_splits_a_run_by_its_running_batch(tmp_path, capsys):
    """``benchmarks/drain_report.py``: a row per batch-size bucket of the record's ``steps_by_batch`` (its span,
    steps, seconds, ms a step, share of the run, the host's ms a step by phase where the record keeps them), the
    seconds after the full batch, and the run's time if every request needed the mean rounds at the full batch's
    step time; only the settings named."""
    record = {
        "setting": "pillar_recent",
        "device": "cpu",
        "tree": "t",
        "tokens_per_s": 100.0,
        "steps": 70,
        "seconds": 10.0,
        "generated_tokens": 800,
        "max_new_tokens": 100,
        "mean_accepted": 3.0,
        "request_accepted_p10_p50_p90": [2.0, 3.0, 3.5],
        "slowest_requests": [{"mean_accepted": 1.5}, {"mean_accepted": 1.75}],
        "steps_by_batch": [
            {
                "batch_from": 8,
                "steps": 40,
                "seconds": 6.0,
                "host_ms_per_step": dict(zip(HOST_PHASES, [1, 20, 125, 4], strict=True)),
            },
            {"batch_from": 2, "steps": 20, "seconds": 3.0},
            {"batch_from": 1, "steps": 10, "seconds": 1.0},
        ],
    }
    table = drain_report.drain_table(record)
    assert "| 8 | 40 | 6.00 | 150.0 | 60% | 1.0 / 20.0 / 125.0 / 4.0 |" in table
    assert "| 2-7 | 20 | 3.00 | 150.0 | 30% | - |" in table and "| 1-1 | 10 | 1.00 | 100.0 | 10% | - |" in table
    assert "After the largest batch (the first request finished): 4.0 s of 10.0 (40%)" in table
    # 100 tokens at 1 + 3 a round: 25 rounds of 150 ms.
    assert "the slowest 1.50, 1.75" in table and "25 rounds, 3.8 s (213 tok/s)" in table
    assert "rounds" not in drain_report.drain_table(record | {"natural_lengths": True})  # lengths differ: no bound
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(json.dumps(record | {"setting": name}) for name in ("pillar_recent", "none")))
    drain_report.main([str(records), "none"])
    printed = capsys.readouterr().out
    assert printed.startswith("none on cpu") and "pillar_recent on" not in printed


def test_the_record_traces_the_batch_and_both_kv_tiers_over_the_run(tmp_path, monkeypatch):
    """An offload run whose pool holds fewer tokens than its requests reach: the record's timeline shows each
    step's requests (never above the batch), the device pool's use (never above its size), the host tier holding
    tokens at some point, tokens moved out and back (cumulative: never falling, all back by the end) and the host's
    milliseconds in each phase of the engine's steps (never falling, within the record's totals);
    ``benchmarks/plot_timeline.py`` draws it. Spaced out to at most the points asked, the trace keeps its ends, and
    the plot's wall time per step between two of its points is that of the steps between them."""
    model = tiny_spec("llama", 2).build()
    prompts = [list(range(3, 3 + n)) for n in (30, 41, 25, 36)]
    record = measure(model, prompts, None, 40, 0.0, offload=True, kv_capacity_tokens=160, max_batch_size=4)
    line = record["timeline"]
    assert set(line) == set(TRACE_FIELDS) and len(line["seconds"]) == record["steps"]
    assert line["seconds"] == sorted(line["seconds"]) and line["seconds"][-1] <= record["seconds"]
    assert max(line["requests"]) <= 4 and max(line["pool_tokens"]) <= record["kv_capacity_tokens"]
    assert max(line["host_tokens"]) > 0 and line["host_tokens"][-1] == 0
    for moved in ("offloaded_tokens", "restored_tokens"):
        assert line[moved] == sorted(line[moved]) and line[moved][-1] == record["offload"][moved] > 0
    for phase, field in zip(HOST_PHASES, HOST_TRACE_FIELDS, strict=True):  # the host's ms so far in each phase
        total = record["host_ms_per_step"][phase] * record["steps"]
        assert line[field] == sorted(line[field]) and 0 < line[field][-1] <= total + 1e-6, (phase, line[field][-1])
    overlap = record["copy_overlap"]  # steps that copied against like steps that did not
    assert overlap["steps_with_copies"] > 0 and overlap["steps_without"] > 0 and overlap["requests"] <= 4
    assert overlap["ms_with_copies"] > 0 and overlap["ms_without"] > 0
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(record | {"setting": "none+offload"}) + "\n")
    plot_timeline.main([str(records), str(tmp_path / "timeline.png"), "none+offload"])
    with Image.open(tmp_path / "timeline.png") as image:
        assert image.format == "PNG" and image.size[0] > 500
    with pytest.raises(SystemExit, match=r"no record with a timeline in .* for pillar"):
        plot_timeline.main([str(records), str(tmp_path / "other.png"), "pillar"])

    wrapped = sparsespec.wrap(model, draft=None, kv_capacity_tokens=512)
    timeline = StepTimeline(wrapped.engine)
    wrapped.generate(torch.tensor([prompts[0]]), max_new_tokens=23, do_sample=False)
    spaced = timeline.sampled_trace(points=5)
    assert len(spaced["seconds"]) <= 6 and len(timeline.trace) > 20
    assert spaced["seconds"][0] == timeline.trace[0][0] and spaced["seconds"][-1] == timeline.trace[-1][0]
    monkeypatch.setattr(plot_timeline, "TRACE_POINTS", 5)
    times, stride = plot_timeline.step_times(spaced["seconds"], len(timeline.trace)), -(-len(timeline.trace) // 5)
    assert times[0] == pytest.approx(1e3 * (timeline.trace[stride][0] - timeline.trace[0][0]) / stride)
    assert len(times) == len(spaced["seconds"]) and times[-1] is None
    with pytest.raises(ValueError, match="does not sample"):
        plot_timeline.step_times(spaced["seconds"][:-1], len(timeline.trace))
