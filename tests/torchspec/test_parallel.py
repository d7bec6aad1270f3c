"""Tensor parallel and data-parallel replicas on torch.distributed: two gloo ranks on the CPU.

One world of two spawned processes runs every distributed case once (the spawn and imports dominate the
time); each rank saves what it saw and the tests below judge it here, against the transformers reference and
a single-process run. fp32 tiny models with peaked logits, so greedy tokens are exact.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.torchspec.conftest import TINY_SHAPE, Batch, run_cli, tiny_spec
from torchspec import cli, sparsespec
from torchspec.bench import step_cost
from torchspec.parallel import BackendError, LayoutError, RowParallelLinear
from torchspec.parallel.layout import check_backend, check_devices, kv_heads_per_rank
from torchspec.parallel.replicas import balanced_split, generate_replicated

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
NEW_TOKENS = 24
BATCH = Batch((5, 11, 3), seed=1)
# name -> (spec, options): Qwen3 with 2 KV heads split one per rank; Llama with 1 KV head replicated on both;
# the padded static path GPUs capture (cuda_graphs=True runs it uncaptured on a CPU); Mistral with an 8-token
# sliding window; offload's host tier.
TP_CASES = {
    "qwen3-plain": (tiny_spec("qwen3"), {"draft": None}),
    "qwen3-pillar_recent": (tiny_spec("qwen3"), {}),
    "llama-kv1-pillar_recent": (tiny_spec("llama", num_kv_heads=1), {}),
    "qwen3-graphs": (tiny_spec("qwen3"), {"cuda_graphs": True}),
    "mistral-window8": (tiny_spec("mistral", sliding_window=8), {}),
    "qwen3-offload": (tiny_spec("qwen3"), {"offload": True}),
}
DP_PROMPTS = [[3 + (7 * i + j) % 120 for j in range(n)] for i, n in enumerate((9, 2, 14, 5, 5, 30, 1))]
OPTIONS = {"max_batch_size": 4, "kv_capacity_tokens": 512}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _error(call: Any) -> str:
    """The type and message ``call()`` raised ('' if it returned)."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _step_costs(out: Path) -> dict[str, Any]:
    """``torchspec bench --model-config tiny --tp 2`` on this rank: its exit code, and what rank 0 wrote."""
    step_cost.MODEL_CONFIGS["tiny"] = TINY_SHAPE
    argv = ["bench", "--model-config", "tiny", "--max-batch-size", "2", "--context", "24", "--tp", str(WORLD)]
    code = cli.main([*argv, "--methods", "none,pillar_recent", "--threads", "1", "--out", str(out)])
    dist.barrier()
    written = {name: (out / name).read_text() for name in ("results.json", "report.md") if (out / name).exists()}
    return {"code": code, **written}


def _worker(rank: int, port: int, out: str) -> None:
    # What torchrun sets (a rank's RANK and the WORLD_SIZE tell the CLI it runs under a launcher).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    # A deadline on every collective: a rank that diverged fails the run instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for name, (spec, options) in TP_CASES.items():
            model = sparsespec.wrap(spec.build(), tensor_parallel_size=WORLD, **OPTIONS, **options)
            results[name] = model.generate(**BATCH.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False)
            results[f"{name}/layer0"] = model.layers[0]
            results[f"{name}/fused_decoders"] = model.engine.fused_layers.count("decoder")
        torch.manual_seed(rank)  # ranks start from different random states; the engine gives them rank 0's
        model = sparsespec.wrap(tiny_spec("qwen3").build(), tensor_parallel_size=WORLD, **OPTIONS)
        sampled = model.generate_batch(DP_PROMPTS[:3], max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0)
        results["sampled"] = [output.token_ids for output in sampled.values()]

        results["error/diverged"] = _error(lambda: model.tensor_parallel.check_same(rank, "the rank"))

        replicas = sparsespec.wrap(tiny_spec("qwen3").build(), **OPTIONS)
        results["dp"] = generate_replicated(replicas, DP_PROMPTS, max_new_tokens=NEW_TOKENS, progress_bar=False)
        if rank == 1:  # this replica fails; the other's requests still complete
            replicas.generate_batch = lambda *args, **kwargs: 1 / 0
        results["dp_failed"] = generate_replicated(replicas, DP_PROMPTS, max_new_tokens=NEW_TOKENS, progress_bar=False)

        bad = {
            "heads": tiny_spec("qwen3", num_kv_heads=1, num_attention_heads=3, hidden_size=48),
            "kv_heads": tiny_spec("qwen3", num_kv_heads=3, num_attention_heads=6, hidden_size=96),
        }
        for name, spec in bad.items():
            results[f"error/{name}"] = _error(lambda spec=spec: sparsespec.wrap(spec.build(), tensor_parallel_size=2))
        results["error/world"] = _error(lambda: sparsespec.wrap(tiny_spec("qwen3").build(), tensor_parallel_size=4))
        results["step_costs"] = _step_costs(Path(out) / "step_costs")
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the two ranks saw."""
    out = tmp_path_factory.mktemp("parallel")
    context = mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two ranks did not finish in 240 s")
    results = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
    return results


@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_greedy_matches_tp1(ranks, hf_reference, case: str) -> None:
    spec, options = TP_CASES[case]
    tp1 = sparsespec.wrap(spec.build(), **OPTIONS, **options).generate(
        **BATCH.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert torch.equal(tp1, hf_reference(spec, BATCH, max_new_tokens=NEW_TOKENS))
    for rank, result in enumerate(ranks):
        assert torch.equal(result[case], tp1), f"rank {rank} of TP=2 differs from TP=1"
        layer = result[f"{case}/layer0"]  # each rank's pool and policy hold its own heads
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        assert result[f"{case}/fused_decoders"] == 2  # sharding and the fused layers compose


def test_tp2_sampling_is_identical_on_every_rank(ranks) -> None:
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert all(len(tokens) == NEW_TOKENS for tokens in ranks[0]["sampled"])


def test_replicas_return_every_output_in_input_order(ranks) -> None:
    single = sparsespec.wrap(tiny_spec("qwen3").build(), **OPTIONS).generate_batch(
        DP_PROMPTS, max_new_tokens=NEW_TOKENS, progress_bar=False
    )
    for result in ranks:
        assert list(result["dp"]) == list(single)  # generate_batch's request ids, in input order
        outputs = list(result["dp"].values())
        assert [o.index for o in outputs] == list(range(len(DP_PROMPTS)))
        assert [o.prompt_ids for o in outputs] == DP_PROMPTS
        assert [o.token_ids for o in outputs] == [o.token_ids for o in single.values()]


def test_a_failed_replica_reports_its_requests_and_the_others_complete(ranks) -> None:
    shares = balanced_split([len(p) + NEW_TOKENS for p in DP_PROMPTS], WORLD)
    outputs = list(ranks[0]["dp_failed"].values())
    assert [o.index for o in outputs] == list(range(len(DP_PROMPTS)))
    for index in shares[0]:
        assert outputs[index].finish_reason == "length"
    for index in shares[1]:
        assert outputs[index].finish_reason == "error"
        assert "replica 1 (rank 1) failed: ZeroDivisionError" in outputs[index].error


def test_impossible_layouts_are_refused_by_name(ranks) -> None:
    errors = ranks[0]
    assert errors["error/heads"].startswith("LayoutError: model.layers.0.self_attn: 3 attention heads")
    assert errors["error/kv_heads"].startswith("LayoutError: model.layers.0.self_attn: 3 KV heads can neither")
    assert errors["error/world"].startswith("LayoutError: tensor_parallel_size=4 does not divide the world of 2")


def test_ranks_that_disagree_fail_together(ranks) -> None:
    for result in ranks:  # each rank held its own number: both raise, neither waits for the other
        assert result["error/diverged"].startswith("RuntimeError: tensor-parallel ranks disagree on the rank")


def test_step_costs_of_a_shape_sharded_over_two_ranks(ranks) -> None:
    """``torchspec bench --model-config --tp 2`` under a launcher: both ranks run every step, the first writes the
    report (which says the shape was sharded)."""
    assert [result["step_costs"]["code"] for result in ranks] == [0, 0]
    results = json.loads(ranks[0]["step_costs"]["results.json"])
    assert results["tensor_parallel_size"] == WORLD and "--tp 2" in results["command"]
    steps = [(cost["method"], cost["step"]) for cost in results["costs"]]
    assert steps == [("none", "plain"), ("pillar_recent", "round"), ("pillar_recent", "round")]
    assert all(cost["steps_timed"] == step_cost.SAMPLES and cost["wall_ms"] > 0 for cost in results["costs"])
    assert "Sharded over 2 GPUs (tensor parallel" in ranks[0]["step_costs"]["report.md"]


def test_step_costs_refuse_a_tp_the_launch_does_not_match(capsys) -> None:
    """``--tp 2`` without two launched processes, and a --tp that the shape's heads do not divide, are refused by
    name before any model is built."""
    step_cost.MODEL_CONFIGS["tiny"] = TINY_SHAPE
    try:
        for tp, message in (
            ("2", "--tp 2 needs as many processes, one a GPU, and this launch has 1"),
            ("3", "4 attention heads are not divisible by tensor_parallel_size=3"),
        ):
            code, _, err = run_cli(capsys, "bench", "--model-config", "tiny", "--tp", tp, "--methods", "none")
            assert code == 2 and message in err, err
        code, _, err = run_cli(capsys, "bench", "--tp", "2", "--methods", "none")
        assert code == 2 and "--tp shards a --model-config shape over GPUs" in err, err
    finally:
        del step_cost.MODEL_CONFIGS["tiny"]


def test_balanced_split_evens_the_load() -> None:
    assert balanced_split([100, 1, 1, 1, 60, 40], 2) == [[0, 1, 3], [2, 4, 5]]  # loads 102 and 101
    assert balanced_split([1, 1, 1, 1], 2) == [[0, 2], [1, 3]]


def test_layout_checks_name_the_problem() -> None:
    assert kv_heads_per_rank(8, 8, 4, "attn") == 2
    assert kv_heads_per_rank(8, 2, 4, "attn") == 1  # fewer KV heads than ranks: each replicated on two
    with pytest.raises(LayoutError, match="8 ranks on this host but only 2 CUDA devices"):
        check_devices("cuda", 8, 2)
    check_devices("cpu", 8, 0)
    with pytest.raises(BackendError, match="needs the 'nccl' process-group backend, but the group has 'gloo'"):
        check_backend("gloo", "cuda")
    check_backend("cpu:gloo,cuda:nccl", "cuda")


def test_tensor_parallel_without_distributed_says_how_to_launch(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = tiny_spec("qwen3").build()
    with pytest.raises(BackendError, match="which is not initialised: launch with torchrun"):
        sparsespec.wrap(model, tensor_parallel_size=2)
    assert not any(isinstance(m, RowParallelLinear) for m in model.modules())  # refused before any change


@pytest.mark.slow
def test_cli_under_torchrun_answers_every_prompt_in_order(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m torchspec generate``: two replicas of the embedded model write what one
    process writes (greedy), in input order."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    args = ["generate", "--reasoning-prompts", "--limit", "3", "--max-new-tokens", "8"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    launchers = {
        "single": [sys.executable, "-m", "torchspec"],
        "replicas": [*torchrun, str(_free_port()), "-m", "torchspec"],
    }
    records = {}
    for name, launcher in launchers.items():
        out = tmp_path / f"{name}.jsonl"
        run = subprocess.run(
            [*launcher, *args, "--output", str(out)], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert run.returncode == 0, run.stderr[-3000:]
        records[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records["single"]) == 3
    assert records["replicas"] == records["single"]
