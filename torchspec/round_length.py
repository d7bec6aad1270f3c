"""How many drafts a step's rounds take: the length that emits the most tokens per millisecond, from each
request's recent acceptance and the measured cost of the engine's own steps (goodput, as SmartSpec chooses it).

Self-speculation pays only where a sparse draft forward is much cheaper than the full forward it stands in for:
many requests at long context, where full attention's K/V reads dominate. With few requests a forward costs its
fixed launch and weight-read time whatever it attends to, a draft costs about what a plain step costs, and a
round loses to plain decoding: on W1 one poorly drafted request, left alone at the end of the run, made 2.3
tokens per 31 ms round where a plain step takes ~2.5 ms. The length never changes what is sampled (greedy
tokens and sampled distributions are those of plain decoding at every length), only how fast.

Costs depend on the batch, so they are kept per batch-size bucket (powers of two). A bucket first measures a
round at full length, then a plain step; afterwards the mode not chosen is measured again every
``REFRESH_STEPS`` steps of the bucket, so a choice follows the costs as contexts grow.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from torchspec.request import SpeculationStats

RECENT_ROUNDS = 16  # a request's acceptance is estimated from its last rounds
# A cost is the median of a bucket's last measurements: a step that captured a graph or compiled a kernel (on
# W1 one round took 355 ms among rounds of 68 ms) does not move it, and a few steps follow a real change.
RECENT_STEPS = 5
REFRESH_STEPS = 32  # a bucket's steps between two measurements of the mode it does not choose


def acceptance_rate(accepted: Sequence[int], drafted: Sequence[int]) -> float:
    """The chance that a draft is accepted once the drafts before it were, from a request's recent rounds: a
    round that accepted ``a`` of ``d`` drafts made ``a`` successful trials, and one failed trial unless
    ``a == d``. One success and one failure of prior keep a new request between the extremes."""
    successes = sum(accepted)
    failures = sum(a < d for a, d in zip(accepted, drafted, strict=True))
    return (successes + 1) / (successes + failures + 2)


def expected_tokens(rates: np.ndarray, k: int) -> np.ndarray:
    """``[requests, k + 1]``: the tokens a round of each length 0..k emits on average, ``1 + rate + ... +
    rate**length`` (the verify's own token, bonus or corrected, included; length 0 is a plain step)."""
    return np.cumsum(rates[:, None] ** np.arange(k + 1), axis=1)


def _median(values: deque[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class StepCosts:
    """Measured milliseconds of a batch-size bucket's steps, the last ``RECENT_STEPS`` of each kind."""

    plain: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # a step without drafts
    # A round's step without its drafts (the first forward, the verify, token selection, bookkeeping), and one
    # more draft forward of a round.
    round: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    draft: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    last_measured: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})  # drafting? -> step

    def costs(self, k: int) -> np.ndarray:
        """``[k + 1]``: the cost of a step with rounds of each length 0..k (0: a plain step)."""
        lengths = np.arange(k + 1)
        return np.where(lengths == 0, _median(self.plain), _median(self.round) + lengths * _median(self.draft))


class RoundLength:
    """Chooses the length of the rounds a step starts; the scheduler asks once per step and reports every
    decoding step's cost back."""

    def __init__(self, k: int, adaptive: bool) -> None:
        self.k = k
        self.adaptive = adaptive
        self._buckets: dict[int, StepCosts] = {}
        self._steps = 0

    def choose(self, requests: Sequence[SpeculationStats]) -> int:
        """The length of the rounds that requests with these speculation records start now."""
        if not self.adaptive or not requests:
            return self.k
        costs = self._buckets.setdefault(_bucket(len(requests)), StepCosts())
        if not costs.round:
            return self.k
        if not costs.plain:
            return 0
        rates = np.array(
            [
                acceptance_rate(stats.accepted_per_round[-RECENT_ROUNDS:], stats.drafts_per_round[-RECENT_ROUNDS:])
                for stats in requests
            ]
        )
        # Tokens the batch makes per ms at each length 0..k.
        tokens = expected_tokens(rates, self.k).sum(axis=0)
        goodput = tokens / costs.costs(self.k)
        best_round = 1 + int(np.argmax(goodput[1:]))
        drafting = bool(goodput[best_round] > goodput[0])
        if self._steps - costs.last_measured[not drafting] >= REFRESH_STEPS:
            drafting = not drafting  # the other mode's costs are stale: measure them again
        return best_round if drafting else 0

    def observe(self, batch: int, length: int, wall_ms: float, draft_ms: float | None) -> None:
        """A decoding step of ``batch`` requests ran rounds of ``length`` drafts (0: plain) in ``wall_ms``; one
        of its later draft forwards took ``draft_ms`` (the chain's forwards back to back, over their count;
        None: the round had none). That is what one more draft adds to a round; the rest of the step (the
        first forward, the verify, the host's share, which at a handful of requests is most of a round) is the
        round's fixed cost. Charging the drafts everything up to their end made short rounds look cheap where
        that fixed cost dominates (W1's tail: a lone request drafting ~2 of 8 ran plain steps of ~3.8 ms, where
        a round of 8 made ~3 tokens for little more)."""
        self._steps += 1
        if not self.adaptive:
            return
        costs = self._buckets.setdefault(_bucket(batch), StepCosts())
        costs.last_measured[length > 0] = self._steps
        if length == 0:
            costs.plain.append(wall_ms)
            return
        if draft_ms is not None:
            costs.draft.append(draft_ms)
        draft = _median(costs.draft)
        if draft is not None:  # a round of one draft alone (no later forward) splits by the drafts measured before
            costs.round.append(max(wall_ms - length * draft, 0.0))


def _bucket(batch: int) -> int:
    """The power of two at or above ``batch``: requests whose steps cost about the same."""
    return 1 << (batch - 1).bit_length()
