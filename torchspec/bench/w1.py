"""W1's set-up for the diagnostics under ``benchmarks/``: the model in bf16 on CUDA, wrapped, its 256 prompts, and
a short warm-up, so what they measure starts with the full batch's graphs captured and kernels compiled."""

from __future__ import annotations

from typing import Any

import torch

from torchspec import sparsespec
from torchspec.models import load_model
from torchspec.workloads import reasoning_prompt_ids

SAMPLING = {"do_sample": True, "temperature": 0.65}  # W1's (with transformers' default top-k 50)
WARMUP_TOKENS = 16


def warmed_up(path: str, draft: str, options: dict[str, Any]) -> tuple[Any, list[list[int]]]:
    """The model at ``path`` wrapped with ``draft`` (``"none"``: no speculation) and engine ``options``, and W1's
    prompts, after a ``WARMUP_TOKENS``-token generation of all of them."""
    model, tokenizer = load_model(path, dtype=torch.bfloat16, device="cuda")
    prompts = [list(prompt) for prompt in reasoning_prompt_ids(tokenizer, 256)]
    wrapped = sparsespec.wrap(model, draft=None if draft == "none" else draft, max_batch_size=256, **options)
    wrapped.generate_batch(prompts, max_new_tokens=WARMUP_TOKENS, min_new_tokens=WARMUP_TOKENS, **SAMPLING)
    return wrapped, prompts
