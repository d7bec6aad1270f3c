"""Shared fixtures: the embedded SmolLM2 model (loaded once per session) and a one-thread guard."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

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
