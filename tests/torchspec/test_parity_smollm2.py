"""The engine with draft=None is token-identical to transformers' own generate on the real SmolLM2 (fp32)."""

from __future__ import annotations

import pytest
import torch

from torchspec import sparsespec
from torchspec.workloads import chat_token_ids, read_prompts

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name a primary colour.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def batch(smollm2):
    """A left-padded batch: two long reasoning prompts and short questions that end with EOS early."""
    _, tokenizer = smollm2
    texts = read_prompts(limit=2) + QUESTIONS[:2]
    prompts = [chat_token_ids(tokenizer, text) for text in texts]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts should differ in length"
    return tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param({"max_new_tokens": 64}, id="eos-stops-short-rows"),
        pytest.param({"max_new_tokens": 72, "min_new_tokens": 72}, id="no-eos-min-new-tokens"),
    ],
)
def test_greedy_batch_matches_transformers(smollm2, batch, lengths):
    """Left-padded batch, 64+ new tokens: same tensor as HF generate, with and without rows stopping at EOS."""
    model, _ = smollm2
    expected = model.generate(**batch, do_sample=False, **lengths)
    wrapped = sparsespec.wrap(model, draft=None, max_step_tokens=256)
    actual = wrapped.generate(**batch, do_sample=False, **lengths)
    assert torch.equal(actual, expected)
    eos = model.generation_config.eos_token_id
    new_tokens = expected[:, batch["input_ids"].shape[1] :]
    stopped = (new_tokens == eos).any(dim=1)
    if "min_new_tokens" in lengths:
        assert not stopped.any() and new_tokens.shape[1] == lengths["max_new_tokens"]
    else:
        assert stopped.any() and not stopped.all(), "the batch should mix rows that stop at EOS and rows that do not"
    pool = wrapped.engine.pool
    assert pool.allocator.num_free == pool.num_slots
    assert wrapped.last_stats.generated_tokens == sum(_generated_length(row, eos) for row in new_tokens)


def _generated_length(row: torch.Tensor, eos: int) -> int:
    """Tokens a row really generated: up to and including its first EOS, else all of them."""
    hits = (row == eos).nonzero()
    return int(hits[0]) + 1 if len(hits) else len(row)
