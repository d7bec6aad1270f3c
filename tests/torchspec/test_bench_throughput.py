"""The end-to-end throughput benchmark generates exactly the requested tokens and reports what ran."""

from __future__ import annotations

import pytest

from torchspec.bench.throughput import measure

pytestmark = pytest.mark.slow


def test_throughput_record_counts_the_real_work(smollm2):
    """Two prompts x 12 tokens on the embedded model (CPU): every request gets all 12 tokens (EOS held back),
    and the record's counts agree with the engine's; speculation reports rounds, plain decoding none."""
    model, tokenizer = smollm2
    prompts = [tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Name a prime.")["input_ids"]]
    plain = measure(model, prompts, None, max_new_tokens=12, temperature=0.65)
    assert plain["generated_tokens"] == 24 and plain["tokens_per_s"] > 0 and plain["mean_accepted"] == 0
    assert plain["steps"] >= 12  # a prefill step, then one decode step per token
    speculative = measure(model, prompts, "pillar_recent", max_new_tokens=12, temperature=0.0)
    assert speculative["generated_tokens"] == 24 and speculative["mean_accepted"] > 0
