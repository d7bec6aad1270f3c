"""The round length follows goodput: drafts that cost about what a plain step costs give way to plain steps,
cheap drafts with good acceptance keep long rounds, and stale costs are measured again."""

from __future__ import annotations

import numpy as np
import pytest

from torchspec.request import SpeculationStats
from torchspec.round_length import RECENT_STEPS, REFRESH_STEPS, RoundLength, acceptance_rate, expected_tokens


def _stats(accepted: list[int], drafted: list[int]) -> SpeculationStats:
    return SpeculationStats(accepted_per_round=accepted, drafts_per_round=drafted)


def test_acceptance_rate_counts_a_failed_trial_only_where_a_draft_was_rejected():
    assert acceptance_rate([], []) == 0.5
    assert acceptance_rate([8], [8]) == pytest.approx(9 / 10)  # eight successes, no failure
    assert acceptance_rate([3], [8]) == pytest.approx(4 / 6)  # three successes, one failure
    assert acceptance_rate([0, 2], [4, 2]) == pytest.approx(3 / 5)


def test_expected_tokens_count_the_verifys_own_token():
    tokens = expected_tokens(np.array([0.0, 1.0, 0.5]), 2)
    assert tokens.tolist() == [[1, 1, 1], [1, 2, 3], [1, 1.5, 1.75]]


def test_costly_drafts_give_way_to_plain_steps():
    """One request alone (W1's tail): a round of 8 drafts took 31 ms, 26 of them drafting, and a plain step
    2.5 ms; at 57% acceptance plain decoding makes more tokens per ms."""
    rounds = RoundLength(8, adaptive=True)
    poor = [_stats([1, 2, 0, 1], [8, 8, 8, 8])]
    assert rounds.choose(poor) == 8  # a new bucket measures a round first
    rounds.observe(1, 8, 31.0, 26.0 / 8)
    assert rounds.choose(poor) == 0  # then a plain step
    rounds.observe(1, 0, 2.5, None)
    assert rounds.choose(poor) == 0


def test_a_round_whose_cost_is_mostly_fixed_beats_plain_steps():
    """One request alone, whose drafts accept ~2 of 8 (W1's straggler): its round costs 8 ms, of which one more
    draft forward adds 0.35 ms (the rest is the verify and the host's fixed share), and a plain step 3.8 ms.
    Rounds of 4 make the most tokens per ms (~2.5 per 6.6 ms, against 2.1 for plain steps): rounds stay."""
    rounds = RoundLength(8, adaptive=True)
    straggler = [_stats([2, 2, 2, 2], [8, 8, 8, 8])]
    rounds.observe(1, 8, 8.0, 0.35)
    rounds.observe(1, 0, 3.8, None)
    assert rounds.choose(straggler) == 4


def test_cheap_drafts_with_good_acceptance_keep_long_rounds():
    """A full batch at long context: drafts 2 ms each, the verify and bookkeeping 24 ms, a plain step 12 ms."""
    rounds = RoundLength(8, adaptive=True)
    good = [_stats([8, 7, 8], [8, 8, 8])] * 256
    rounds.observe(256, 8, 40.0, 2.0)
    rounds.observe(256, 0, 12.0, None)
    assert rounds.choose(good) == 8
    poor = [_stats([0, 1, 0], [8, 8, 8])] * 256
    assert rounds.choose(poor) == 0


def test_costs_are_kept_per_batch_size_and_measured_again_when_stale():
    rounds = RoundLength(8, adaptive=True)
    poor = [_stats([0], [8])]
    rounds.observe(1, 8, 30.0, 26.0 / 8)
    rounds.observe(1, 0, 2.0, None)
    assert rounds.choose([_stats([8], [8])] * 100) == 8  # another bucket: its own costs, measured afresh
    chosen = []
    for _ in range(2 * REFRESH_STEPS):
        length = rounds.choose(poor)
        chosen.append(length)
        rounds.observe(1, length, 30.0 if length else 2.0, 26.0 / length if length else None)
    assert chosen.count(0) >= 2 * REFRESH_STEPS - 2
    assert 1 <= sum(length > 0 for length in chosen) <= 2, chosen  # the round's costs measured again


def test_a_fixed_round_length_ignores_costs():
    rounds = RoundLength(4, adaptive=False)
    rounds.observe(1, 4, 30.0, 26.0 / 4)
    rounds.observe(1, 0, 2.0, None)
    assert rounds.choose([_stats([0], [4])]) == 4


def test_one_slow_step_does_not_move_the_costs():
    """A round that captured a graph (W1: 355 ms among rounds of 68 ms) is one measurement among the last few:
    the choice stays; rounds that really got slower move it within a few steps."""
    rounds = RoundLength(8, adaptive=True)
    good = [_stats([8, 7, 8], [8, 8, 8])] * 256
    for _ in range(3):
        rounds.observe(256, 8, 68.0, 5.0)
    rounds.observe(256, 0, 16.0, None)
    assert rounds.choose(good) == 8
    rounds.observe(256, 8, 355.0, 5.0)
    assert rounds.choose(good) == 8
    for _ in range(RECENT_STEPS):
        rounds.observe(256, 8, 355.0, 37.5)
    assert rounds.choose(good) == 0
