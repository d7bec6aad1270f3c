"""The command line: ``python -m torchspec generate`` answers with the embedded model, writes JSON lines, and
refuses bad arguments with a non-zero exit and a message naming the problem (not a traceback).

The end-to-end run goes through a real ``python -m torchspec`` subprocess from a source checkout (no pip
install); everything else calls ``torchspec.cli.main`` in-process, which is much cheaper, with the loaded model
shared between calls.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.torchspec.conftest import run_cli
from torchspec import cli

REPO_ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(
    r"^\d+ requests(, \d+ failed)?: \d+ prompt \+ \d+ generated tokens in [\d.]+ s \(\d+ steps\), [\d.]+ tok/s"
    r"(, mean accepted [\d.]+ of [\d.]+ drafted)?$"
)


def _summary_line(stderr: str) -> str:
    """The last line of stderr: the run's one-line summary (progress bars come before it)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


def _run_module(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m torchspec generate ...`` with only the repo root on PYTHONPATH, from another directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "torchspec", "generate", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``torchspec generate *argv``, in-process."""
    return run_cli(capsys, "generate", *argv)


@pytest.fixture(scope="module")
def _model_cache() -> dict:
    return {}


@pytest.fixture
def shared_model(monkeypatch: pytest.MonkeyPatch, _model_cache: dict) -> Iterator[None]:
    """Load each (model, dtype, device) once for the module instead of once per ``main`` call."""
    real = cli.load_model

    @functools.wraps(real)
    def load_model(model: Any = None, dtype: Any = torch.float32, device: Any = "cpu") -> Any:
        key = (model, str(dtype), str(device))
        if key not in _model_cache:
            _model_cache[key] = real(model, dtype=dtype, device=device)
        return _model_cache[key]

    monkeypatch.setattr(cli, "load_model", load_model)
    yield


class _NoWeights:
    """Stands in for AutoModelForCausalLM where a test says no weights may be loaded."""

    @staticmethod
    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded although the arguments were already known to be bad")


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if ``main`` gets as far as reading model weights."""
    monkeypatch.setattr("torchspec.models.AutoModelForCausalLM", _NoWeights)


# -- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_one_prompt_end_to_end(tmp_path: Path) -> None:
    """The documented first command works with no --model: an answer on stdout, the summary on stderr."""
    result = _run_module("What is 2+2?", "--max-new-tokens", "16", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = result.stdout.strip()
    assert answer, "no answer on stdout"
    assert "4" in answer, answer  # greedy fp32 on the chat template: "The answer ... is 4."
    summary = _summary_line(result.stderr)
    assert SUMMARY.match(summary) and summary.startswith("1 requests:"), summary


@pytest.mark.slow
@pytest.mark.usefixtures("shared_model")
def test_reasoning_prompts_to_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--reasoning-prompts --limit 2 --output writes one JSON record per prompt (and no answers on stdout)."""
    output = tmp_path / "answers.jsonl"
    code, out, err = _main(
        capsys, "--reasoning-prompts", "--limit", "2", "--max-new-tokens", "8", "--output", str(output)
    )
    assert code == 0, err[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert set(record) == {"prompt", "answer", "finish_reason", "error", "generated_tokens"}
        assert "\\boxed{}" in record["prompt"]  # the packaged prompts carry the reasoning instruction
        assert record["answer"].strip() and record["error"] is None
        assert record["finish_reason"] in ("stop", "length") and 1 <= record["generated_tokens"] <= 8
    assert not out.strip(), out
    summary = _summary_line(err)
    assert SUMMARY.match(summary) and summary.startswith("2 requests:"), summary


@pytest.mark.slow
@pytest.mark.usefixtures("shared_model")
def test_prompts_file_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A .jsonl prompts file without --output prints each answer under its index."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Say hi.", "What is 3+3?"]))
    code, out, err = _main(capsys, "--prompts-file", str(prompts), "--max-new-tokens", "4")
    assert code == 0, err[-3000:]
    assert re.search(r"^\[0\] \S", out, re.M) and re.search(r"^\[1\] \S", out, re.M), out
    assert _summary_line(err).startswith("2 requests:")


# -- bad arguments -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_arguments_exit_nonzero_from_the_module(tmp_path: Path) -> None:
    """``python -m torchspec`` turns a bad argument into a non-zero exit status and a one-line message."""
    result = _run_module(cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    assert result.stderr.strip() == "error: give a prompt or --prompts-file / --reasoning-prompts (one of them)"
    assert "Traceback" not in result.stderr


def _assert_refused(capsys: pytest.CaptureFixture, argv: tuple[str, ...], message: str) -> None:
    code, _, err = _main(capsys, *argv)
    assert code not in (0, None), f"{argv} exited {code}"
    assert re.search(message, err), err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param((), r"give a prompt or --prompts-file", id="no-prompt"),
        pytest.param(("hi", "--reasoning-prompts"), r"\(one of them\)", id="prompt-and-file"),
        pytest.param(("hi", "--draft", "nosuch"), r"argument --draft: invalid choice: 'nosuch'", id="draft=nosuch"),
        pytest.param(("hi", "--max-new-tokens", "ten"), r"--max-new-tokens: invalid int value", id="not-an-int"),
        pytest.param(
            ("hi", "--model", "/nonexistent"), r"'/nonexistent' is not a local transformers directory", id="model"
        ),
    ],
)
@pytest.mark.usefixtures("no_model_load")
def test_bad_arguments_refused_before_loading(capsys: pytest.CaptureFixture, argv: tuple, message: str) -> None:
    """Arguments that are wrong on their face are refused at once (no model load) with a clear message."""
    _assert_refused(capsys, argv, message)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_model")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(("hi", "--max-new-tokens", "-1"), r"max_new_tokens.*-1", id="max-new-tokens=-1"),
        pytest.param(("hi", "--temperature", "0.5", "--top-p", "0"), r"top_p must be in \(0, 1\]", id="top-p=0"),
        pytest.param(("hi", "--temperature", "0.5", "--top-k", "-3"), r"top_k must be .* got -3", id="top-k=-3"),
        pytest.param(("hi", "--max-batch-size", "0"), r"max_batch_size must be .* got 0", id="max-batch-size=0"),
        pytest.param(("--prompts-file", "/nonexistent.jsonl"), r"/nonexistent\.jsonl", id="missing-prompts-file"),
    ],
)
def test_bad_arguments_refused(capsys: pytest.CaptureFixture, argv: tuple, message: str) -> None:
    """Values only the library can judge are refused with its message (exit status 2, no traceback)."""
    _assert_refused(capsys, argv, message)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_model")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ("hi", "--temperature", "-1", "--max-new-tokens", "2"),
            r"temperature.*-1",
            id="temperature=-1",
        ),
        pytest.param(
            ("--reasoning-prompts", "--limit", "0"),
            r"--limit",
            id="limit=0",
        ),
        pytest.param(
            ("--prompts-file", "{prompts}", "--limit", "-1", "--max-new-tokens", "2"),
            r"--limit",
            id="limit=-1",
        ),
        pytest.param(
            ("hi", "--dtype", "float33"),
            r"float33",
            id="dtype=float33",
        ),
        pytest.param(
            ("hi", "--device", "tpu"),
            r"tpu",
            id="device=tpu",
        ),
    ],
)
def test_bad_argument_values_refused(tmp_path: Path, capsys: pytest.CaptureFixture, argv: tuple, message: str) -> None:
    """Bad option values (negative temperature or limit, unknown dtype or device) exit non-zero with a message
    naming the option, before any model is loaded or prompt generated."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    _assert_refused(capsys, tuple(a.format(prompts=prompts) for a in argv), message)
