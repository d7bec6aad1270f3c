"""Shared fixtures: the embedded SmolLM2 model (loaded once per session and worker) and a one-thread guard."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # Workers of one run share the cores: each takes its share of intra-op threads, not all of them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter; triton.jit reads this when a kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in fp32 on CPU."""
    from torchspec.models import load_model

    return load_model(dtype=torch.float32, device="cpu")


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Tiny shapes: intra-op threads only add overhead, and stall badly on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
