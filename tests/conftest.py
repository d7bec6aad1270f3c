"""Shared fixtures: the embedded SmolLM2 model, loaded once per session (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in fp32 on CPU."""
    from torchspec.models import load_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_model(dtype=torch.float32, device="cpu")
