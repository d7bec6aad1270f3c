"""``torchspec bench --model-config``: what each kind of engine step costs on a large model's shape with random
weights, reported like the workload runs (results.json, report.md, a PNG); refused before the model is built when
it cannot run. CPU runs use a tiny shape added to the known ones."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.torchspec.conftest import TINY_SHAPE, run_cli
from torchspec.bench import step_cost

Bench = Callable[..., tuple[int, str, str]]
TINY = TINY_SHAPE


@pytest.fixture
def bench(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Bench:
    """``bench(*argv)``: (exit code, stdout, stderr) of ``torchspec bench *argv`` with a ``tiny`` shape known."""
    monkeypatch.setitem(step_cost.MODEL_CONFIGS, "tiny", TINY)
    return functools.partial(run_cli, capsys, "bench")


def test_step_costs_of_plain_steps_and_rounds_of_two_lengths(bench: Bench, tmp_path: Path) -> None:
    """Each method's steps are timed once the whole batch decodes (only such steps count, so a kind the engine
    never ran would not finish), reported with acceptance stated as not measured, and plotted."""
    argv = ("--model-config", "tiny", "--max-batch-size", "3", "--context", "40", "--methods", "none,pillar_recent")
    code, stdout, err = bench(*argv, "--threads", "1", "--out", str(tmp_path))
    assert code == 0, err[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["model_config"] == "tiny" and results["shape"] == TINY
    assert (results["batch"], results["context"]) == (3, 40)
    assert "--context 40" in results["command"] and "--output-len" not in results["command"]  # this mode's options
    steps = [(cost["method"], cost["step"], cost["k"]) for cost in results["costs"]]
    assert steps == [("none", "plain", 8), ("pillar_recent", "round", 8), ("pillar_recent", "round", step_cost.SHORT_K)]
    on_gpu = torch.cuda.is_available()  # the GPU time split is profiled on CUDA only
    for cost in results["costs"]:
        assert cost["steps_timed"] == step_cost.SAMPLES and cost["wall_ms"] > 0 and cost["host_ms"] > 0, cost
        if on_gpu:
            assert cost["gpu_busy_ms"] > 0 and cost["attention_ms"] >= 0, cost
        else:
            assert cost["gpu_busy_ms"] is None and cost["attention_ms"] is None, cost
    report = (tmp_path / "report.md").read_text()
    assert "**Acceptance is not measured**" in report
    gpu_cells = r"[\d.]+ \| [\d.]+" if on_gpu else r"- \| -"
    assert re.search(rf"\| pillar_recent round, k=8 \| [\d.]+ \| [\d.]+ \| {gpu_cells} \| [\d.]+ \|", report)
    assert re.search(r"- pillar_recent: each draft forward adds -?[\d.]+ ms to a round; .* pays once it emits", report)
    assert stdout.splitlines()[0].startswith("none plain step: ")
    with Image.open(tmp_path / step_cost.PLOT) as image:
        assert image.format == "PNG" and image.size[0] > 100
        image.verify()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ("--model-config", "qwen4-8b"), r"unknown model config 'qwen4-8b'; choose from qwen3-1.7b", id="name"
        ),
        pytest.param(
            ("--model-config", "tiny", "--model", "x.gguf"), r"--model and --model-config exclude", id="model"
        ),
        pytest.param(("--model-config", "tiny", "--sweep", "batch=1,2"), r"--sweep does not apply", id="sweep"),
        pytest.param(
            ("--model-config", "tiny", "--methods", "none,hf"), r"drop the peers hf from --methods", id="peer"
        ),
        pytest.param(("--model-config", "tiny", "--context", "0"), r"--context: must be >= 1", id="context"),
    ],
)
def test_bad_step_cost_arguments_are_refused_before_the_model_is_built(
    bench: Bench, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    def no_model(*args: object) -> None:
        raise AssertionError("the model was built although the arguments were already known to be bad")

    monkeypatch.setattr(step_cost, "build_model", no_model)
    code, _, err = bench(*argv, "--out", str(tmp_path / "out"))
    assert code == 2 and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_a_batch_the_gpu_cannot_hold_is_refused_with_both_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-8B at 128 requests of 8K tokens: 16.4 GB of weights and 154.6 GB of K/V (147,456 bytes a token),
    more than an H200 holds; the message names both and the fixes. Over two GPUs each holds half of the K/V."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (139.7e9, 150e9))
    message = step_cost.memory_error("qwen3-8b", 128, 8192, torch.device("cuda", 0), torch.bfloat16)
    assert message == (
        "qwen3-8b at 128 requests x 8192 tokens needs 16.4 GB of weights and 154.6 GB of K/V; cuda:0 has 139.7 GB "
        "free: lower --max-batch-size or --context, or shard it over more GPUs (--tp)"
    )
    sharded = step_cost.memory_error("qwen3-8b", 128, 8192, torch.device("cuda", 0), torch.bfloat16, 2)
    assert sharded is None, "each of two GPUs holds 4 of the 8 KV heads: 77.3 GB of K/V beside the whole weights"
    sharded = step_cost.memory_error("qwen3-8b", 256, 8192, torch.device("cuda", 0), torch.bfloat16, 2)
    assert "needs 16.4 GB of weights and 154.6 GB of K/V (its share over 2 GPUs)" in sharded
    assert step_cost.memory_error("qwen3-8b", 64, 8192, torch.device("cuda", 0), torch.bfloat16) is None
    assert step_cost.memory_error("qwen3-8b", 10**6, 8192, torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.parametrize(
    ("name", "billions"), [("qwen3-1.7b", 1.7), ("qwen3-8b", 8.2), ("qwen3-14b", 14.8)], ids=lambda v: str(v)
)
def test_known_shapes_have_their_published_sizes(name: str, billions: float) -> None:
    """Parameter counts (embeddings included, once where tied) as Qwen3's model cards give them: 1.7B, 8.2B,
    14.8B. A shape typo shows here."""
    config = step_cost.model_config(name)
    assert step_cost.weight_bytes(config, torch.bfloat16) / 2 / 1e9 == pytest.approx(billions, abs=0.05)
    assert step_cost.kv_bytes_per_token(config, torch.bfloat16) == config.num_hidden_layers * 2 * 8 * 128 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU time is profiled on CUDA only")
def test_gpu_time_of_each_step_is_profiled(bench: Bench, tmp_path: Path) -> None:
    """On a GPU every step kind reports its busy time and the attention's share of it, the longer round more."""
    argv = ("--model-config", "tiny", "--max-batch-size", "4", "--context", "300", "--methods", "none,pillar_recent")
    code, _, err = bench(*argv, "--device", "cuda", "--out", str(tmp_path))
    assert code == 0, err[-3000:]
    costs = json.loads((tmp_path / "results.json").read_text())["costs"]
    for cost in costs:
        assert 0 < cost["attention_ms"] < cost["gpu_busy_ms"], cost
    plain, long, short = costs
    assert long["gpu_busy_ms"] > short["gpu_busy_ms"] > plain["gpu_busy_ms"]
