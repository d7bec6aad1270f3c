"""``torchspec bench``: one command measures ours and transformers' peers on one workload and writes a report a
person reads (results.json, report.md, PNG plots); bad arguments are refused before any model loads.

The runs call ``torchspec.cli.main`` in-process with the session's SmolLM2 (or a tiny random model with its
tokenizer, for the sweeps) standing in for the suite's model load.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers.generation.continuous_batching import ContinuousMixin

from tests.torchspec.conftest import run_cli, tiny_spec
from torchspec.bench import records, suite
from torchspec.bench.methods import METHODS
from torchspec.bench.runs import Workload
from torchspec.bench.throughput import context_bins

Bench = Callable[..., tuple[int, str, str]]


@pytest.fixture
def bench(capsys: pytest.CaptureFixture) -> Bench:
    """``bench(*argv)``: (exit code, stdout, stderr) of ``torchspec bench *argv``, in-process."""
    return functools.partial(run_cli, capsys, "bench")


def _serve(monkeypatch: pytest.MonkeyPatch, model: Any, tokenizer: Any) -> None:
    monkeypatch.setattr(suite, "load_model", lambda *args, **kwargs: (model, tokenizer))


def _valid_png(path: Path) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100, path
        image.verify()


@pytest.mark.slow
def test_bench_measures_ours_and_hf_and_writes_the_report(
    bench: Bench, monkeypatch: pytest.MonkeyPatch, smollm2: Any, tmp_path: Path
) -> None:
    """The issue's CPU run: two of ours and ``hf``, 4 prompts, 32 tokens each. Every method generates all the
    tokens and reports a speed; speculation reports its acceptance (histogram and context bins agreeing with
    each other); the report's table lists each method, and the plots are images."""
    _serve(monkeypatch, *smollm2)
    out = tmp_path / "report"
    argv = ("--methods", "none,pillar_recent,hf", "--num-prompts", "4", "--output-len", "32", "--warmup-tokens", "2")
    threads = torch.get_num_threads()
    code, stdout, err = bench(*argv, "--threads", "1", "--out", str(out))  # one thread: a busy CPU stalls two
    assert code == 0, err[-3000:]
    assert torch.get_num_threads() == threads  # restored
    assert {p.name for p in out.iterdir()} == {
        "results.json",
        "report.md",
        "tokens_per_s.png",
        "acceptance_vs_context.png",
    }
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["device"] == "cpu" and results["environment"]["transformers"]
    assert results["environment"]["threads"] == 1 and results["environment"]["load_average"] >= 0
    assert results["environment"]["tree"] == records.source_tree()
    assert results["workload"]["num_prompts"] == 4 and results["workload"]["output_len"] == 32
    runs = {run["method"]: run for run in results["runs"]}
    assert list(runs) == ["none", "pillar_recent", "hf"]
    for run in runs.values():
        assert run["generated_tokens"] == 4 * 32 and run["requests"] == 4, run
        assert run["tokens_per_s"] > 0 and run["time_per_output_token_ms"] > 0 and run["warmup_s"] > 0, run
        assert run["configuration"]
    ours = runs["pillar_recent"]
    assert 0 < ours["mean_accepted"] <= ours["k"] == 8
    rounds = sum(ours["accepted_histogram"])
    assert len(ours["accepted_histogram"]) == 9 and rounds > 0
    assert sum(b["rounds"] for b in ours["acceptance_by_context"]) == rounds
    assert ours["peak_pool_tokens"] > 4 * 125 and ours["ms_per_step"] > 0
    assert runs["none"]["mean_accepted"] is None and runs["hf"]["mean_accepted"] is None
    report = (out / "report.md").read_text()
    for method in runs:
        assert f"\n| {method} | " in report, report
        assert f"\n- {method}: " in report  # its configuration
    assert "Warm-up: before its timed run each method decodes 2 tokens" in report
    for png in ("tokens_per_s.png", "acceptance_vs_context.png"):
        _valid_png(out / png)
        assert f"]({png})" in report
    summary = stdout.splitlines()
    assert summary[0].startswith("none: ") and " tok/s" in summary[0]
    assert "mean accepted" in summary[1] and summary[2].startswith("hf: ")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sweep", "requests"),
    [("output-len=3,6", {3: 2, 6: 2}), ("batch=1,3", {1: 1, 3: 3})],
    ids=["output-len", "batch"],
)
def test_sweeps_run_every_method_at_every_value(
    bench: Bench, monkeypatch: pytest.MonkeyPatch, smollm2: Any, tmp_path: Path, sweep: str, requests: dict
) -> None:
    """A sweep runs each method (here also the static-cache and continuous-batching peers) at each value, on a
    tiny random model for speed, and plots tokens/s against the swept value."""
    tokenizer = smollm2[1]
    model = tiny_spec("llama", vocab_size=len(tokenizer), max_position_embeddings=512).build()
    _serve(monkeypatch, model, tokenizer)
    methods = "none,pillar_recent,hf-static,hf-cb"
    argv = ("--methods", methods, "--sweep", sweep, "--num-prompts", "2", "--output-len", "4", "--warmup-tokens", "1")
    code, stdout, err = bench(*argv, "--threads", "1", "--out", str(tmp_path))
    assert code == 0, err[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    name = sweep.partition("=")[0]
    assert results["sweep"] == name
    points = [(run["method"], run["sweep_value"]) for run in results["runs"]]
    assert points == [(method, value) for value in requests for method in methods.split(",")]
    for run in results["runs"]:
        tokens = run["sweep_value"] if name == "output-len" else 4
        assert run["requests"] == requests[run["sweep_value"]], run
        assert run["generated_tokens"] == run["requests"] * tokens and run["tokens_per_s"] > 0, run
    first = next(iter(requests))
    assert stdout.splitlines()[0].startswith(f"none ({name}={first}): ")
    _valid_png(tmp_path / f"tokens_per_s_vs_{name.replace('-', '_')}.png")
    assert f"| {name} |" in (tmp_path / "report.md").read_text()


def test_a_run_stopped_part_way_keeps_the_finished_methods_reported(
    bench: Bench, monkeypatch: pytest.MonkeyPatch, smollm2: Any, tmp_path: Path
) -> None:
    """The report is written after every run: stopped during its second method (a time limit, Ctrl-C), the first
    method's numbers are in results.json and report.md already."""
    tokenizer = smollm2[1]
    _serve(monkeypatch, tiny_spec("llama", vocab_size=len(tokenizer), max_position_embeddings=512).build(), tokenizer)

    def stopped(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setitem(METHODS, "pillar_recent", stopped)
    argv = ("--methods", "none,pillar_recent", "--num-prompts", "2", "--output-len", "4", "--warmup-tokens", "1")
    with pytest.raises(KeyboardInterrupt):
        bench(*argv, "--threads", "1", "--out", str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert [run["method"] for run in results["runs"]] == ["none"]
    assert results["runs"][0]["generated_tokens"] == 2 * 4
    assert "| none |" in (tmp_path / "report.md").read_text()


def test_a_method_of_ours_carries_settings_for_its_run_alone(
    bench: Bench, monkeypatch: pytest.MonkeyPatch, smollm2: Any, tmp_path: Path
) -> None:
    """``pillar_recent+k=2+sparsity=0.5`` runs pillar_recent with k=2 and sparsity 0.5, reported under that name
    and configuration, beside pillar_recent at its defaults in the same report: k and sparsity chosen with one
    command."""
    tokenizer = smollm2[1]
    _serve(monkeypatch, tiny_spec("llama", vocab_size=len(tokenizer), max_position_embeddings=512).build(), tokenizer)
    methods = "pillar_recent,pillar_recent+k=2+sparsity=0.5"
    argv = ("--methods", methods, "--num-prompts", "2", "--output-len", "6", "--warmup-tokens", "1")
    code, _, err = bench(*argv, "--temperature", "0", "--threads", "1", "--out", str(tmp_path))
    assert code == 0, err[-3000:]
    runs = {run["method"]: run for run in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert list(runs) == methods.split(",")
    default, set_apart = runs["pillar_recent"], runs["pillar_recent+k=2+sparsity=0.5"]
    assert default["k"] == 8 and set_apart["k"] == 2
    assert len(set_apart["accepted_histogram"]) == 3 and sum(set_apart["accepted_histogram"]) > 0
    assert "draft=pillar_recent, k=2, sparsity=0.5" in set_apart["configuration"]
    assert "draft=pillar_recent, k=8, sparsity=0.05" in default["configuration"]
    assert "| pillar_recent+k=2+sparsity=0.5 |" in (tmp_path / "report.md").read_text()


class _NoModel:
    """Stands in for the suite's model load where the arguments are already known to be bad."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded although the arguments were already known to be bad")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ("--methods", "none,pilar"),
            r"unknown method 'pilar'; choose from none, pillar_recent, .*, hf, hf-static, hf-cb",
            id="method",
        ),
        pytest.param(("--methods", ","), r"no method named", id="no-method"),
        pytest.param(
            ("--methods", "none,hf-static+compile"),
            r"bad method 'hf-static\+compile': settings .* apply to torchspec's methods only",
            id="peer-setting",
        ),
        pytest.param(
            ("--methods", "pillar_recent+sparsity=1.5"),
            r"bad method 'pillar_recent\+sparsity=1.5': sparsity must be in \(0, 1\], got 1.5",
            id="setting-range",
        ),
        pytest.param(("--methods", "none+top_k=5"), r"bad option '\+top_k=5' in 'none\+top_k=5'", id="setting-name"),
        pytest.param(
            ("--model-config", "qwen3-1.7b", "--methods", "pillar_recent+k=4"),
            r"--model-config measures each method at its defaults; drop the settings of pillar_recent\+k=4",
            id="model-config-setting",
        ),
        pytest.param(("--sweep", "batches=1,2"), r"bad sweep 'batches=1,2': use output-len=N,N,", id="sweep-name"),
        pytest.param(("--sweep", "output-len=1k"), r"values are whole numbers", id="sweep-value"),
        pytest.param(("--sweep", "batch=0,32"), r"sweep value 0 of batch out of range", id="sweep-range"),
        pytest.param(("--out", "{file}/report"), r"cannot write the report into .*is not a folder", id="out"),
        pytest.param(("--prompts-file", "{missing}"), r"cannot read prompts from .*missing\.jsonl", id="prompts"),
        pytest.param(("--num-prompts", "0"), r"--num-prompts: must be >= 1", id="num-prompts"),
        pytest.param(("--device", "tpu"), r"unknown device 'tpu'", id="device"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(
    bench: Bench, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    monkeypatch.setattr(suite, "load_model", _NoModel())
    (tmp_path / "file").write_text("")
    paths = {"file": tmp_path / "file", "missing": tmp_path / "missing.jsonl"}
    code, _, err = bench(*(arg.format(**paths) for arg in argv), "--out", str(tmp_path / "out"))
    assert code == 2 and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_a_peer_the_installed_transformers_lacks_is_named(bench: Bench, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without transformers' continuous batching, ``hf-cb`` is refused with what is missing, before any load."""
    monkeypatch.setattr(suite, "load_model", _NoModel())
    monkeypatch.delattr(ContinuousMixin, "continuous_batching_context_manager")
    code, _, err = bench("--methods", "none,hf-cb")
    assert code == 2
    assert "method 'hf-cb' needs transformers.GenerationMixin.continuous_batching_context_manager" in err, err


@pytest.mark.slow
def test_a_workload_cycles_its_prompts_file(smollm2: Any, tmp_path: Path) -> None:
    """More prompts than the file holds: the file again from its start, each in the chat template."""
    path = tmp_path / "prompts.txt"
    path.write_text("one\ntwo\nthree\n")
    workload = Workload.from_file(smollm2[1], path, 5, output_len=8)
    assert len(workload.prompts) == 5 and workload.prompts[3:] == workload.prompts[:2]
    assert len(set(workload.prompts[:3])) == 3 and workload.batch_size == 5
    assert Workload.from_file(smollm2[1], path, 5, output_len=8, max_batch_size=2).batch_size == 2


def test_acceptance_is_binned_by_context_length() -> None:
    rounds = [(10, 8), (511, 4), (512, 2), (1600, 0), (1700, 1)]
    assert context_bins(rounds, 512) == [
        {"context_from": 0, "rounds": 2, "mean_accepted": 6.0},
        {"context_from": 512, "rounds": 1, "mean_accepted": 2.0},
        {"context_from": 1536, "rounds": 2, "mean_accepted": 0.5},
    ]


def test_a_record_names_its_files_by_the_tree_git_would_commit(tmp_path: Path) -> None:
    """``content_tree_id`` is the tree ``git add -A && git write-tree`` gives (nested, executable, untracked and
    ignored files, a tracked file deleted since), so a record from a copy whose history lags its files still
    finds its commit; the repository is left as it was."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    repo, index = tmp_path / "repo", str(tmp_path / "scratch-index")

    def git(*args: str, **env: str) -> str:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=os.environ | env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    (repo / "pkg" / "sub").mkdir(parents=True)
    git("init", "-q")
    files = {"pkg/a.py": "a = 1", "pkg/sub/b.py": "b = 2", "pkg-x.txt": "after pkg/ in git's order", "gone.txt": ""}
    for name, text in {**files, "run.sh": "#!/bin/sh", ".gitignore": "*.log"}.items():
        (repo / name).write_text(text + "\n")
    (repo / "run.sh").chmod(0o755)
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t", "commit", "-q", "-m", "c")
    assert records.content_tree_id(repo) == git("rev-parse", "HEAD^{tree}")
    (repo / "gone.txt").unlink()
    for name, text in {"pkg/a.py": "a = 3", "pkg/new.py": "untracked", "out.log": "ignored"}.items():
        (repo / name).write_text(text + "\n")
    status = git("status", "--porcelain")
    found = records.content_tree_id(repo)
    assert git("status", "--porcelain") == status
    git("read-tree", "HEAD", GIT_INDEX_FILE=index)
    git("add", "-A", GIT_INDEX_FILE=index)
    assert found == git("write-tree", GIT_INDEX_FILE=index) != git("rev-parse", "HEAD^{tree}")


def test_a_record_names_the_commit_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records carry the checkout's commit (``-dirty`` with uncommitted changes to tracked files), so a number is
    traced to its code without a hand-written tag; outside a git checkout (an installed wheel, no git) it is None."""
    package = Path(records.__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=package, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    tree = records.source_tree()
    assert tree is not None and tree.removesuffix("-dirty") == head.stdout.strip(), (tree, head.stdout)
    assert records.environment("cpu", torch.float32)["tree"] == tree

    def no_git(*args: Any, **kwargs: Any) -> None:
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert records.source_tree() is None
