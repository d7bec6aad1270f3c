"""The engine with draft=None is token-identical to transformers' own generate on the real SmolLM2 (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


@pytest.fixture(scope="module")
def reference(smollm2, batch) -> Callable[..., torch.Tensor]:
    """``reference(**generate_kwargs)``: transformers' own greedy ``generate`` of the batch, run once per options."""
    model, _ = smollm2
    cache: dict[tuple, torch.Tensor] = {}

    def run(**kwargs: Any) -> torch.Tensor:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = model.generate(**batch, do_sample=False, **kwargs)
        return cache[key]

    return run


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param({"max_new_tokens": 64}, id="eos-stops-short-rows"),
        pytest.param({"max_new_tokens": 72, "min_new_tokens": 72}, id="no-eos-min-new-tokens"),
    ],
)
def test_greedy_batch_matches_transformers(smollm2, batch, reference, lengths):
    """Left-padded batch, 64+ new tokens: same tensor as HF generate, with and without rows stopping at EOS."""
    model, _ = smollm2
    expected = reference(**lengths)
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


@pytest.mark.parametrize("draft", [None, "pillar_recent"])
def test_repetition_penalty_and_min_p_match_transformers(smollm2, batch, reference, draft):
    """repetition_penalty=1.3 with min_p (which greedy decoding ignores, as transformers does): the same tensor
    as HF generate, without speculation and with it (sparse drafts on the long prompts: some rejected)."""
    model, _ = smollm2
    options = {"max_new_tokens": 64, "repetition_penalty": 1.3, "min_p": 0.1}
    expected = reference(**options)
    assert not torch.equal(expected, reference(max_new_tokens=64)), "the penalty changes nothing: test is vacuous"
    wrapped = sparsespec.wrap(model, draft=draft, max_step_tokens=256)
    assert torch.equal(wrapped.generate(**batch, do_sample=False, **options), expected)
    stats = wrapped.last_stats
    if draft is not None:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats.accepted_histogram


def _generated_length(row: torch.Tensor, eos: int) -> int:
    """Tokens a row really generated: up to and including its first EOS, else all of them."""
    hits = (row == eos).nonzero()
    return int(hits[0]) + 1 if len(hits) else len(row)
