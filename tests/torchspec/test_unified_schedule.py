"""``unified_schedule=True``: the paper's unified phase buckets.

Each decoding request's first round is cut so that its verify lands in the step ahead with the fewest verifies;
after that every round takes k + 1 steps, so the batch's verifies stay spread over a round's phases and every
step is one forward of about B / (k + 1) verifies and drafts for the rest. Greedy output must equal draft=None's
token for token for every policy, synchronous or delayed, through the dynamic and the graphs' padded path,
with EOS and min_new_tokens landing mid-round; no slot may leak. The sampled case is in
test_speculative_sampling.py.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.torchspec.conftest import Batch, assert_no_slot_leak, tiny_spec
from torchspec import sparsespec
from torchspec.drafting import POLICIES
from torchspec.step import Phase, StepPlan

SPEC = tiny_spec("llama", 2)
BATCH = Batch((40, 77, 9, 150, 101, 23, 60, 31, 12, 88), seed=3)
MAX_NEW_TOKENS = 24
OPTIONS = {"k": 4, "min_budget": 8, "sparsity": 0.1, "kv_capacity_tokens": 4096}


def _plans(monkeypatch: pytest.MonkeyPatch, wrapped) -> list[StepPlan]:
    """Every plan the runner launches, in order."""
    runner, plans = wrapped.engine.runner, []
    launch = runner.launch

    def spy(plan: StepPlan):
        plans.append(plan)
        return launch(plan)

    monkeypatch.setattr(runner, "launch", spy)
    return plans


def _steady_verifies(plans: list[StepPlan], k: int) -> list[int]:
    """Verifies of each steady step: every request decodes (prompts all in, none finished) and every verify checks
    a full round (the first rounds, cut to place the requests, and the last ones, cut to the tokens allowed, are
    not steady)."""
    return [
        sum(item.phase is Phase.VERIFY for item in plan.scheduled)
        for plan in plans
        if len(plan.scheduled) == len(BATCH.lengths)
        and all(item.phase is Phase.DRAFT or item.num_query_tokens == k + 1 for item in plan.scheduled)
    ]


def test_unified_schedule_spreads_the_verifies_over_a_rounds_steps(monkeypatch):
    """Ten requests that finish their prompts in the same step, k = 4: in steady steps the unified schedule
    verifies at most ceil(10 / 5) = 2 of them per step, and some in every step; the in-phase schedule (one draft
    per step) verifies all ten together."""
    steps = {}
    for unified in (True, False):
        wrapped = sparsespec.wrap(
            SPEC.build(), draft="pillar_recent", unified_schedule=unified, draft_chain=False, **OPTIONS
        )
        plans = _plans(monkeypatch, wrapped)
        wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        steps[unified] = _steady_verifies(plans, OPTIONS["k"])
        assert len(steps[unified]) > 2 * (OPTIONS["k"] + 1), "too few steady steps to tell"
    most = math.ceil(len(BATCH.lengths) / (OPTIONS["k"] + 1))
    assert max(steps[True]) == most and min(steps[True]) >= 1, steps[True]
    assert max(steps[False]) == len(BATCH.lengths), steps[False]


@functools.cache
def _plain_tokens(kwargs: tuple[tuple[str, int], ...]) -> torch.Tensor:
    """draft=None's greedy tokens for BATCH with these generate() arguments (computed once per module)."""
    baseline = sparsespec.wrap(SPEC.build(), draft=None, kv_capacity_tokens=4096)
    return baseline.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **dict(kwargs))


@pytest.mark.parametrize("cuda_graphs", [None, True], ids=["dynamic", "graphs"])
@pytest.mark.parametrize("delayed_verify", [False, True], ids=["synchronous", "delayed"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_unified_schedule_gives_the_draft_none_tokens(policy, delayed_verify, cuda_graphs):
    """Every draft policy under the unified schedule, synchronous or delayed, dynamic or padded: greedy tokens
    equal draft=None's plainly, with EOS (rows stop anywhere, mid-round included) and with min_new_tokens
    holding it back; no slot leaks."""
    eos = int(_plain_tokens(())[0, BATCH.lengths[0] + 3])  # a token some row makes early: as EOS it stops rows
    for kwargs in ({}, {"eos_token_id": eos}, {"eos_token_id": eos, "min_new_tokens": 7}):
        expected = _plain_tokens(tuple(kwargs.items()))
        wrapped = sparsespec.wrap(
            SPEC.build(),
            draft=policy,
            unified_schedule=True,
            delayed_verify=delayed_verify,
            cuda_graphs=cuda_graphs,
            **OPTIONS,
        )
        actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
        assert torch.equal(expected, actual), f"{policy} {kwargs}\n{actual}\n{expected}"
        assert_no_slot_leak(wrapped)
        assert wrapped.last_stats.num_rounds > 0


def test_unified_schedule_turns_draft_chains_off_and_refuses_them_by_name():
    """A chain runs a whole round in one step, which the unified schedule spreads over k + 1 steps: draft_chain
    left at None resolves off; draft_chain=True, and adaptive_rounds=True (it times whole rounds), are refused at
    wrap() with the conflict and the fix."""
    assert not sparsespec.wrap(SPEC.build(), draft="pillar_recent", unified_schedule=True).engine.draft_chain
    assert sparsespec.wrap(SPEC.build(), draft="pillar_recent").engine.draft_chain
    with pytest.raises(ValueError, match=r"draft_chain=True cannot run with unified_schedule=True: .* use"):
        sparsespec.wrap(SPEC.build(), draft="pillar_recent", unified_schedule=True, draft_chain=True)
    with pytest.raises(ValueError, match=r"adaptive_rounds=True needs draft chains .* and unified_schedule=False"):
        sparsespec.wrap(SPEC.build(), draft="pillar_recent", unified_schedule=True, adaptive_rounds=True)
