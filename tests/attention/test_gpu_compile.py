"""The Triton kernels compile for the H100/H200 on a machine without a GPU (see ``gpu_compile``: what the CPU
interpreter cannot catch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.attention.gpu_compile import SCENARIOS

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile and run them")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    """Every scenario compiled in one process with the interpreter off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.attention.gpu_compile"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kernel_launches_compile_for_sm90(compiled, scenario):
    """Decode, verify, prefill, sliding-window, fp32, fused draft + verify and verify-score launches (split ones
    with their merge), the layer, logits and Top-K kernels and the key sketch's (store, scoring, lists) compile to a
    cubin for sm_90."""
    assert compiled[scenario] == "ok", compiled[scenario]
