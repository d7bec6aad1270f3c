"""A wave of prompts prefills before anything decodes; a newcomer joining a running batch does not pause it.

A batch decoding while it fills runs each step at another batch size, and each size captures its CUDA graphs once
(W3 with offload captured ~45 of its 69 graphs on its way up to 1,024 requests)."""

from __future__ import annotations

import pytest

from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import sparsespec
from torchspec.request import SamplingParams
from torchspec.step import Phase, StepPlan

MAX_STEP_TOKENS = 12


def _steps(
    draft: str | None, lengths: tuple[int, ...], max_batch_size: int, new_tokens: tuple[int, ...] | None = None
) -> list[tuple[int, int]]:
    """Each step's (prompt tokens, decoding requests) of a greedy run over prompts of ``lengths``, each making
    ``new_tokens`` (6 each by default)."""
    wrapped = sparsespec.wrap(
        tiny_spec("llama").build(),
        draft=draft,
        k=3,
        min_budget=4,
        max_batch_size=max_batch_size,
        max_step_tokens=MAX_STEP_TOKENS,
        kv_capacity_tokens=512,
    )
    steps: list[tuple[int, int]] = []

    def record(plan: StepPlan, finished: list) -> None:
        prefill = [item for item in plan.scheduled if item.phase is Phase.PREFILL]
        steps.append((sum(item.num_query_tokens for item in prefill), len(plan.scheduled) - len(prefill)))

    engine = wrapped.engine
    prompts, tokens = Batch(lengths, seed=1).prompts, new_tokens or (6,) * len(lengths)
    requests = [
        engine.new_request(i, list(prompt), SamplingParams(max_new_tokens=count, do_sample=False))
        for i, (prompt, count) in enumerate(zip(prompts, tokens, strict=True))
    ]
    engine.run(requests, on_step=record)
    assert all(request.num_output_tokens == request.params.max_new_tokens for request in requests)
    return steps


@pytest.mark.parametrize("draft", [None, "pillar_recent"])
def test_a_wave_of_prompts_prefills_before_anything_decodes(draft):
    """Four prompts of 81 tokens against a step budget of 12: no step decodes while more than a step's worth of
    prompt is left (decoding starts with the last prompt chunk)."""
    steps = _steps(draft, (9, 30, 17, 25), max_batch_size=4)
    first = next(i for i, (_, decoding) in enumerate(steps) if decoding)
    assert sum(prompt for prompt, _ in steps[:first]) >= 81 - MAX_STEP_TOKENS, steps
    assert sum(prompt for prompt, _ in steps[first:]) <= MAX_STEP_TOKENS, steps


def test_a_newcomer_prefills_beside_the_running_batch():
    """Three prompts, two at a time: the third, admitted when one finishes, prefills in steps that decode the
    other too."""
    steps = _steps(None, (9, 5, 7), max_batch_size=2, new_tokens=(12, 3, 6))
    late = [i for i, (prompt, decoding) in enumerate(steps) if prompt and decoding]
    assert late, steps
