"""Speculative sampling is lossless: the acceptance rules alone, then the whole engine, checked statistically.

Every statistical check is a chi-square test run with fixed seeds. The significance level was fixed before
looking at any result: each test fails when one of its ``m`` p-values is below ``ALPHA / m`` (Bonferroni,
``ALPHA = 1e-3``), so a correct implementation that merely draws other random numbers (a changed seed, a
reordered RNG call) fails a given test with probability at most 1e-3. Hard invariants (a token of probability
0 is never emitted, EOS never before ``min_new_tokens``) are exact assertions, not tests.

The engine samples from the global torch RNG (no generator is set), so every engine run is seeded with
``torch.manual_seed`` inside ``torch.random.fork_rng``. Reference distributions come from the model's own
transformers forward and transformers' own processors and warpers, never from torchspec's sampling code.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.torchspec.conftest import tiny_spec
from torchspec import sparsespec
from torchspec.draft_probs import KeptDistributions
from torchspec.sampling import DenseProbs
from torchspec.speculative import accept_greedy, accept_sampled

pytestmark = pytest.mark.usefixtures("single_thread")

ALPHA = 1e-3  # family-wise significance level of each test (see the module docstring)
MIN_EXPECTED = 5.0  # chi-square cells expected to hold fewer samples are pooled into one


# -- chi-square tests --------------------------------------------------------------------------------------------


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, statistic/2)."""
    if dof <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``counts`` (any shape) being a sample of ``probs`` (same shape, sums to 1).

    Cells expected to hold fewer than MIN_EXPECTED samples are pooled into one. A sample in a cell of
    probability 0 is an outright failure, not a small p-value.
    """
    counts, probs = counts.flatten().double(), probs.flatten().double()
    impossible = counts[probs == 0].sum()
    assert impossible == 0, f"{int(impossible)} samples fell on outcomes of probability 0"
    expected = probs * counts.sum()
    big = expected >= MIN_EXPECTED
    observed, expected = (
        torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]]),
        torch.cat([expected[big], expected[~big].sum()[None]]),
    )
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    return chi2_sf(float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1)


def two_sample(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of two count tables (same shape) being samples of one distribution (2 x K contingency table).

    Outcomes seen fewer than 2 * MIN_EXPECTED times in both samples together are pooled into one.
    """
    a, b = a.flatten().double(), b.flatten().double()
    big = (a + b) >= 2 * MIN_EXPECTED
    a = torch.cat([a[big], a[~big].sum()[None]])
    b = torch.cat([b[big], b[~big].sum()[None]])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total = a + b
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    statistic = ((a - expected_a) ** 2 / expected_a).sum() + ((b - expected_b) ** 2 / expected_b).sum()
    return chi2_sf(float(statistic), len(total) - 1)


def binomial_p_value(successes: int, trials: int, probability: float) -> float:
    """Two-sided p-value of a binomial count (normal approximation: trials * p * (1 - p) is large here)."""
    if probability in (0.0, 1.0):
        return 1.0 if successes == probability * trials else 0.0
    z = (successes - trials * probability) / math.sqrt(trials * probability * (1 - probability))
    return math.erfc(abs(z) / math.sqrt(2))


def assert_p_values(p_values: dict[str, float], context: str = "") -> None:
    """Every p-value above ALPHA / m (Bonferroni over the m checks of one test)."""
    threshold = ALPHA / len(p_values)
    shown = ", ".join(f"{name} {p:.3g}" for name, p in p_values.items())
    failed = [name for name, p in p_values.items() if not p > threshold]
    assert not failed, f"{context}: {failed} below {threshold:.2g}; all p-values: {shown}"


def count_table(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, n]`` token ids -> ``[V] * n`` counts of each n-tuple."""
    counts = torch.zeros((vocab_size,) * tokens.shape[1], dtype=torch.long)
    counts.index_put_(tuple(tokens.T), torch.ones(len(tokens), dtype=torch.long), accumulate=True)
    return counts


# -- accept_greedy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("targets", "drafts", "accepted", "tokens"),
    [
        ([5], [], 0, [5]),  # no drafts: the target's argmax
        ([1, 2, 3], [1, 2], 2, [1, 2, 3]),  # all match: the bonus argmax after the last draft
        ([1, 2, 3], [1, 4], 1, [1, 2]),  # mismatch: the matching prefix and the argmax replacing it
        ([7, 2, 3], [1, 2], 0, [7]),  # first draft wrong: later matches do not count
        ([4, 4, 4, 9], [4, 4, 4], 3, [4, 4, 4, 9]),
        ([0, 1, 2, 3, 4], [0, 1, 9, 3], 2, [0, 1, 2]),
    ],
)
def test_accept_greedy(targets, drafts, accepted, tokens):
    """accept_greedy keeps exactly the prefix of drafts equal to the target argmax and appends the argmax at the
    first mismatch (or the bonus argmax): the emitted tokens are plain greedy decoding's. Each case runs in a
    batch next to a longer round, so it is padded: padding that happens to equal the argmax must not count."""
    n = len(drafts)
    width = n + 2
    pad_targets = targets + [targets[-1]] * (width + 1 - len(targets))  # padding equal to the argmax
    target_tokens = torch.tensor([pad_targets, list(range(width + 1))])
    padded = torch.tensor([drafts + pad_targets[n:width], list(range(width))])
    got_accepted, got_next = accept_greedy(target_tokens, padded, torch.tensor([n, width]))
    assert got_accepted.tolist() == [accepted, width]
    assert [*drafts[:accepted], got_next[0].item()] == tokens
    assert got_next[1].item() == width  # the other round: all drafts match, then the bonus argmax


# -- accept_sampled ------------------------------------------------------------------------------------------------

UNIT_VOCAB = 6
UNIT_TRIALS = 6000


def _distribution(generator: torch.Generator, *shape: int, zero: Sequence[int] = (), scale: float = 1.5):
    """Random distributions over the last axis, with probability exactly 0 on the ``zero`` tokens."""
    logits = torch.randn(*shape, UNIT_VOCAB, generator=generator, dtype=torch.float64) * scale
    logits[..., list(zero)] = -math.inf
    return logits.softmax(-1)


def _one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), UNIT_VOCAB).double()


def _unit_case(name: str) -> dict[str, torch.Tensor]:
    """Targets p0 [V], p1 [V, V] and p2 [V, V, V] (conditioned on the tokens before), drafts q0 [V], q1 [V, V]."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    p0, p1, p2 = _distribution(g), _distribution(g, UNIT_VOCAB), _distribution(g, UNIT_VOCAB, UNIT_VOCAB)
    if name == "full_support":
        q0, q1 = _distribution(g), _distribution(g, UNIT_VOCAB)
    elif name == "q_zero_where_p_positive":  # residual sampling must produce the tokens the draft never proposes
        q0, q1 = _distribution(g, zero=[0, 1, 2]), _distribution(g, UNIT_VOCAB, zero=[3, 4])
    elif name == "p_zero_where_q_positive":  # like top-k / top-p filtered targets: such drafts are always rejected
        p0, p1 = _distribution(g, zero=[4, 5]), _distribution(g, UNIT_VOCAB, zero=[0, 5])
        q0, q1 = _distribution(g), _distribution(g, UNIT_VOCAB)
    elif name == "equal":  # p == q: every draft is accepted
        q0, q1 = p0.clone(), p1.clone()
    elif name == "disjoint":  # no overlap: every draft is rejected
        p0, p1 = _distribution(g, zero=[0, 1, 2]), _distribution(g, UNIT_VOCAB, zero=[0, 1, 2])
        q0, q1 = _distribution(g, zero=[3, 4, 5]), _distribution(g, UNIT_VOCAB, zero=[3, 4, 5])
    elif name == "point_mass":  # n-gram proposals: fixed tokens, q = one_hot (as the runner builds it)
        q0 = _one_hot(int(p0.argmax()))
        q1 = _one_hot(int(p1[int(p0.argmax())].argmax())).expand(UNIT_VOCAB, -1)
    elif name == "point_mass_on_impossible_token":  # a proposal the target forbids (an EOS before min_new_tokens)
        p0, p1 = _distribution(g, zero=[2]), _distribution(g, UNIT_VOCAB, zero=[3])
        q0, q1 = _one_hot(2), _one_hot(3).expand(UNIT_VOCAB, -1)
    else:
        raise ValueError(name)
    return {"p0": p0, "p1": p1, "p2": p2, "q0": q0, "q1": q1}


UNIT_CASES = [
    "full_support",
    "q_zero_where_p_positive",
    "p_zero_where_q_positive",
    "equal",
    "disjoint",
    "point_mass",
    "point_mass_on_impossible_token",
]


def _kept(probs: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor, supports: bool) -> KeptDistributions:
    """Draft distributions ``probs`` (``[S, c, V]``) as the draft steps keep them, round j's drafts
    ``drafts[j]`` drawn from row ``rows[j]``: whole rows, or (``supports``) each row as its tokens in a random
    order and two entries of padding (token 0, probability 0)."""
    drawn = torch.rand(probs.shape[:2], generator=torch.Generator().manual_seed(6))  # noise where no draft is
    n = drafts.shape[1]
    drawn[rows, :n] = probs[rows, :n].gather(2, drafts[..., None])[..., 0]
    if not supports:
        return KeptDistributions(drawn=drawn, probs=probs, tokens=None)
    tokens = torch.rand(probs.shape, generator=torch.Generator().manual_seed(7)).argsort(dim=-1)
    padding = torch.zeros(*probs.shape[:2], 2, dtype=torch.int64)
    shuffled = probs.gather(2, tokens)
    return KeptDistributions(
        drawn=drawn, probs=torch.cat([shuffled, padding.float()], dim=2), tokens=torch.cat([tokens, padding], dim=2)
    )


def _accept(
    target: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    num_drafts: torch.Tensor,
    generator,
    supports: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_sampled on rounds given as ``[J, n + 1, V]`` targets and ``[J, n, V]`` drafts, laid out as the
    runner hands them over: target rows in one ``[J * (n + 1), V]`` tensor, drafts in a store of more rows (round
    j in row 2j + 1) and more drafts than the rounds have (one spare column of noise the rule must not read),
    kept as whole rows or (``supports``) as supports."""
    rounds, n = drafts.shape
    target_rows = torch.arange(rounds * (n + 1)).view(rounds, n + 1)
    store = torch.rand(2 * rounds + 1, n + 1, target.shape[-1], generator=torch.Generator().manual_seed(5))
    store[1::2, :n] = draft_probs
    draft_rows = torch.arange(rounds) * 2 + 1
    kept = _kept(store, drafts, draft_rows, supports)
    return accept_sampled(
        DenseProbs(target.flatten(0, 1)), target_rows, drafts, kept, draft_rows, num_drafts, generator
    )


@pytest.mark.parametrize("supports", [False, True], ids=["whole-rows", "supports"])
@pytest.mark.parametrize("name", UNIT_CASES)
def test_accept_sampled_is_exact(name, supports):
    """Two drafts d1 ~ q0, d2 ~ q1[d1] verified against p0, p1[d1] and p2[d1, d2]: the emitted tokens are
    distributed as p0(t1), p0(t1) p1(t2 | t1) and p0(t1) p1(t2 | t1) p2(t3 | t1, t2) (tokens missing after a
    rejection are drawn from p1 / p2, as the next decode steps would). The first draft's acceptance rate is
    sum(min(p0, q0)), the optimum: rejecting more would still be exact, but slower.

    Protects the rejection-sampling rule of speculative.py for the draft shapes the engine produces: sparse
    self-drafts (full or partial support), filtered targets (zeros in p), n-gram proposals (one-hot q), and the
    bonus token after full acceptance. With 6000 trials a wrong residual (p instead of max(0, p - q)), a bonus
    from the wrong row, or one uniform shared by both drafts fail several cases with p-values below 1e-15.
    """
    case = _unit_case(name)
    p0, p1, p2, q0, q1 = (case[key] for key in ("p0", "p1", "p2", "q0", "q1"))
    g = torch.Generator().manual_seed(1234)
    d1 = torch.multinomial(q0.float(), UNIT_TRIALS, replacement=True, generator=g)
    d2 = torch.multinomial(q1[d1].float(), 1, generator=g)[:, 0]
    # what the following decode steps would sample, given the tokens so far: [V, trials] and [V * V, trials]
    next_second = torch.multinomial(p1.float(), UNIT_TRIALS, replacement=True, generator=g)
    next_third = torch.multinomial(p2.reshape(-1, UNIT_VOCAB).float(), UNIT_TRIALS, replacement=True, generator=g)
    target = torch.stack([p0.expand(UNIT_TRIALS, -1), p1[d1], p2[d1, d2]], dim=1).float()
    draft_probs = torch.stack([q0.expand(UNIT_TRIALS, -1), q1[d1]], dim=1).float()
    num_drafts = torch.full((UNIT_TRIALS,), 2)
    accepted, next_token = _accept(
        target, torch.stack([d1, d2], dim=1), draft_probs, num_drafts, torch.Generator().manual_seed(99), supports
    )
    emitted, first_accepted = [], 0
    for trial, (a, b, kept, corrected) in enumerate(
        zip(d1.tolist(), d2.tolist(), accepted.tolist(), next_token.tolist(), strict=True)
    ):
        tokens = [*[a, b][:kept], corrected]
        first_accepted += kept >= 1
        if len(tokens) == 1:
            tokens.append(int(next_second[tokens[0], trial]))
        if len(tokens) == 2:
            tokens.append(int(next_third[tokens[0] * UNIT_VOCAB + tokens[1], trial]))
        emitted.append(tokens)
    counts = count_table(torch.tensor(emitted), UNIT_VOCAB)
    joint = p0[:, None, None] * p1[:, :, None] * p2
    acceptance = float(torch.minimum(p0, q0).sum())
    assert_p_values(
        {
            "t1": goodness_of_fit(counts.sum((1, 2)), joint.sum((1, 2))),
            "t1t2": goodness_of_fit(counts.sum(2), joint.sum(2)),
            "t1t2t3": goodness_of_fit(counts, joint),
            "first draft acceptance rate": binomial_p_value(first_accepted, UNIT_TRIALS, acceptance),
        },
        f"{name} (acceptance {first_accepted / UNIT_TRIALS:.3f}, expected {acceptance:.3f})",
    )


def test_accept_sampled_never_accepts_a_zero_probability_draft(monkeypatch):
    """A draft the target gives probability 0 (outside top-k / top-p, or EOS before min_new_tokens) is never
    accepted, even when the uniform draw is exactly 0.0, which torch.rand returns with probability 2**-24.

    Protects the exactness of the acceptance test ``u < p / q``: written as ``u * q <= p`` it accepts such a
    draft whenever u == 0.0, emitting a token the target forbids. Deterministic: torch.rand is made to return 0.
    """
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.zeros(*shape, dtype=torch.float32))
    target = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for draft_probs in (torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.4, 0.3, 0.3])):
        accepted, next_token = _accept(
            target[None],
            torch.tensor([[0]]),
            draft_probs[None, None],
            torch.tensor([1]),
            torch.Generator().manual_seed(0),
        )
        assert int(accepted) == 0, f"draft 0 has target probability 0 but was accepted (q = {draft_probs.tolist()})"
        assert int(next_token) != 0


def test_accept_sampled_reads_no_distribution_past_a_rounds_drafts():
    """Rounds with fewer drafts than the widest (a final prompt chunk beside full rounds) keep whatever the store
    holds past their drafts: the rule must read neither p nor q there. Round 0 drafts token 2 with p = q (always
    accepted) and then takes its bonus from the target row after it, [0.5, 0.5, 0, ...]; the store's column
    past its draft holds q = one-hot(0), which a wrong correction would subtract (never emitting token 0). Round
    1 has no drafts at all: its next token comes from its first target row alone."""
    trials, vocab = 4000, UNIT_VOCAB
    target = torch.zeros(2 * trials, 3, vocab)
    target[:, 0, 2] = 1.0
    target[:, 1, :2] = 0.5
    target[:, 2] = 1.0 / vocab  # padding row: never read
    target[trials:, 0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    store = torch.zeros(2 * trials, 2, vocab)
    store[:, 0, 2] = 1.0
    store[:, 1, 0] = 1.0  # past every round's drafts: noise the rule must not read
    drafts = torch.tensor([[2, 0]]).expand(2 * trials, -1)
    num_drafts = torch.cat([torch.ones(trials, dtype=torch.long), torch.zeros(trials, dtype=torch.long)])
    target_rows = torch.arange(2 * trials)[:, None] * 3 + torch.minimum(torch.arange(3), num_drafts[:, None])
    rows = torch.arange(2 * trials)
    accepted, next_token = accept_sampled(
        DenseProbs(target.flatten(0, 1)), target_rows, drafts, _kept(store, drafts, rows, supports=False), rows,
        num_drafts, torch.Generator().manual_seed(3),
    )  # fmt: skip
    assert accepted[:trials].eq(1).all() and accepted[trials:].eq(0).all()
    assert next_token[trials:].eq(4).all(), "a round without drafts must sample its first target row"
    zeros = int(next_token[:trials].eq(0).sum())
    assert next_token[:trials].lt(2).all() and binomial_p_value(zeros, trials, 0.5) > 1e-6, zeros


# -- the engine end to end -----------------------------------------------------------------------------------------

VOCAB = 16
SPEC = tiny_spec("llama", vocab_size=VOCAB)  # initializer_range 0.2: next-token entropy well between 0 and log V
# Found by search: repeated tokens, so n-gram lookup proposes drafts, and a next-token distribution that stays
# spread out under both sampling settings (entropy 2.0 nats at temperature 1, 1.15 warped; log 16 = 2.77) with
# no top-k / top-p cut near a tie on any reachable prefix.
PROMPT = [10, 10, 14, 5, 7, 12, 13, 10, 3, 5]
NUM_SAMPLES = 1200
NEW_TOKENS = 4  # k = 2: one round drafts tokens 2 and 3 and adds a bonus 4th, or rejects and starts another
K = 2
PENALISED = "t0.8-rp1.5-minp0.15"
SAMPLING = {
    "t1": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
    "t0.7-k8": {"temperature": 0.7, "top_k": 8, "top_p": 1.0},  # the kind of transformers' default (top_k=50)
    "t0.7-k8-p0.9": {"temperature": 0.7, "top_k": 8, "top_p": 0.9},
    # Every token so far penalised (the prompt's, and in a round the drafts before it): penalising the prompt's
    # alone moves tokens 2-3 by a total variation of 0.16. min_p leaves 6 of the 16 tokens first. Found by search,
    # as PROMPT: other penalties and min_p values put a min-p cut within 1e-4 of a reachable probability ratio.
    PENALISED: {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.5, "min_p": 0.15},
}


def _warped_probs(
    logits: torch.Tensor,
    inputs: torch.Tensor,
    reachable: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
):
    """transformers' processors and warpers (in transformers' order and on/off rules) and softmax of ``[R, V]``
    logits, row r after the tokens ``inputs[r]``.

    The engine's logits differ from transformers' by fp32 rounding, so on the ``reachable`` rows (prefixes of
    nonzero probability) no top-k, top-p or min-p cut may be within 1e-4 of flipping.
    """
    if repetition_penalty != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(repetition_penalty)(inputs, logits)
    scores = TemperatureLogitsWarper(temperature)(None, logits) if temperature != 1.0 else logits
    if top_k > 0:
        descending = scores[reachable].sort(dim=-1, descending=True).values
        gap = (descending[:, top_k - 1] - descending[:, top_k]).min()
        assert gap > 1e-4, f"a top-k cut is within {gap:.2g} of a tie"
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        cumulative = scores[reachable].sort(dim=-1).values.softmax(-1).cumsum(-1)
        gap = (cumulative - (1 - top_p)).abs().min()
        assert gap > 1e-4, f"a top-p cut is within {gap:.2g} of a cumulative probability"
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0.0:
        probs = scores[reachable].softmax(-1)
        gap = (probs / probs.amax(-1, keepdim=True) - min_p).abs().min()
        assert gap > 1e-4, f"a min-p cut is within {gap:.2g} of a probability ratio"
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores.softmax(-1).double()


@functools.cache
def exact_joint(sampling: str, prompt: tuple[int, ...] = tuple(PROMPT), banned_before: int = 0, banned: int = -1):
    """The exact distribution ``[V] * NEW_TOKENS`` of the first NEW_TOKENS tokens of plain sampling.

    Built from transformers forwards of the prompt followed by every possible continuation; ``banned`` gets
    probability 0 at the first ``banned_before`` positions (what min_new_tokens does to an EOS id).
    """
    model = SPEC.build()
    joint = torch.ones((), dtype=torch.float64)
    for step in range(NEW_TOKENS):
        continuations = list(itertools.product(range(VOCAB), repeat=step))
        continuations = torch.tensor(continuations, dtype=torch.long).reshape(VOCAB**step, step)
        inputs = torch.cat([torch.tensor(prompt).expand(len(continuations), -1), continuations], dim=1)
        with torch.inference_mode():
            logits = model(input_ids=inputs).logits[:, -1].float()
        logits = logits.clone()  # (an inference tensor cannot be edited outside inference mode)
        if step < banned_before:
            logits[:, banned] = -math.inf
        conditional = _warped_probs(logits, inputs, joint.flatten() > 0, **SAMPLING[sampling])
        joint = joint[..., None] * conditional.reshape((VOCAB,) * (step + 1))
    return joint


def _wrap(
    draft: str | None,
    num_samples: int,
    prompt: Sequence[int],
    max_new_tokens: int,
    draft_chain: bool | None = None,
    delayed_verify: bool | None = None,
    cuda_graphs: bool | None = None,
    unified_schedule: bool = False,
    min_budget: int = 4,
):
    """A fresh model wrapped so all samples are one batch: prefill in one step, decode in lockstep (or, with
    ``unified_schedule``, their rounds spread over the phases). The default ``min_budget``: pillar drafts attend
    to 1 Top-K position + those since the verify, far from the target."""
    return sparsespec.wrap(
        SPEC.build(),
        draft=draft,
        draft_chain=draft_chain,
        delayed_verify=delayed_verify,
        cuda_graphs=cuda_graphs,
        unified_schedule=unified_schedule,
        k=K,
        min_budget=min_budget,
        sparsity=0.05,
        max_batch_size=num_samples,
        kv_capacity_tokens=num_samples * (len(prompt) + max_new_tokens + K),
        max_step_tokens=num_samples * len(prompt),
    )


def generate(wrapped: Any, seed: int, prompt: Sequence[int], num_samples: int, max_new_tokens: int, **kwargs: Any):
    """``generate_batch([prompt] * num_samples)`` with sampling, under ``torch.manual_seed(seed)``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return list(
            wrapped.generate_batch(
                [list(prompt)] * num_samples,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                progress_bar=False,
                **kwargs,
            ).values()
        )


@functools.cache
def sampled_tokens(
    draft: str | None,
    sampling: str,
    draft_chain: bool | None = None,
    delayed_verify: bool | None = None,
    cuda_graphs: bool | None = None,
    unified_schedule: bool = False,
) -> tuple[torch.Tensor, Any]:
    """``[NUM_SAMPLES, NEW_TOKENS]`` tokens sampled by the engine from PROMPT, and the run's stats.

    Each setting gets its own seed, so the samples of different settings are independent.
    """
    seeds = {
        (None, None, None): 0,
        ("pillar", None, None): 1,
        ("ngram", None, None): 2,
        ("pillar", False, None): 3,
        ("pillar", None, True): 4,
    }
    seed = (
        seeds.get((draft, draft_chain, delayed_verify), 6) + (7 if cuda_graphs else 0) + (11 if unified_schedule else 0)
    )
    wrapped = _wrap(draft, NUM_SAMPLES, PROMPT, NEW_TOKENS, draft_chain, delayed_verify, cuda_graphs, unified_schedule)
    chained = draft in ("pillar", "query_sketch") and draft_chain is None and not unified_schedule
    assert wrapped.engine.draft_chain is chained
    assert wrapped.engine.delayed_verify is (draft is None if delayed_verify is None else delayed_verify)
    outputs = generate(wrapped, seed, PROMPT, NUM_SAMPLES, NEW_TOKENS, **SAMPLING[sampling])
    if cuda_graphs and wrapped.engine.draft_chain:
        assert wrapped.engine.runner.chain_graphs._steps, "the chains did not run through the chain graphs"
    stats = wrapped.last_stats
    assert all(len(o.token_ids) == NEW_TOKENS and o.finish_reason == "length" for o in outputs)
    return torch.tensor([o.token_ids for o in outputs]), stats


def _p_values_against_exact(counts: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """Each single token and each adjacent pair against the exact marginals."""
    p_values = {}
    for i in range(NEW_TOKENS):
        others = tuple(j for j in range(NEW_TOKENS) if j != i)
        p_values[f"t{i + 1} exact"] = goodness_of_fit(counts.sum(others), joint.sum(others))
    for i in range(NEW_TOKENS - 1):
        others = tuple(j for j in range(NEW_TOKENS) if j not in (i, i + 1))
        p_values[f"t{i + 1}t{i + 2} exact"] = goodness_of_fit(counts.sum(others), joint.sum(others))
    return p_values


def test_tiny_model_is_a_useful_sampler():
    """The test model's next-token distribution after PROMPT is neither near-uniform nor near a point mass, in
    both sampling settings (entropy between 20% and 90% of log V): otherwise the statistics below test nothing."""
    for sampling in SAMPLING:
        first = exact_joint(sampling).sum(dim=tuple(range(1, NEW_TOKENS)))
        entropy = float(-(first * first.clamp(min=1e-300).log()).sum())
        assert 0.2 * math.log(VOCAB) < entropy < 0.9 * math.log(VOCAB), f"{sampling}: entropy {entropy:.3f}"
        assert float(first.max()) < 0.9


@pytest.mark.parametrize("delayed_verify", [None, False], ids=["delayed", "synchronous"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_plain_sampling_matches_the_exact_distribution(sampling, delayed_verify):
    """draft=None: the engine's samples of the first 4 tokens (each one and adjacent pairs) follow the exact
    distribution from transformers' forward and warpers, with delayed verification (each step fed the last
    one's tokens on the device) and without. Validates the reference the speculative runs are compared with
    (and the plain sampling path); Bonferroni over the 7 comparisons."""
    tokens, _ = sampled_tokens(None, sampling, delayed_verify=delayed_verify)
    p_values = _p_values_against_exact(count_table(tokens, VOCAB), exact_joint(sampling))
    assert_p_values(p_values, f"None {sampling} delayed_verify={delayed_verify}")


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize(
    ("draft", "draft_chain", "cuda_graphs", "delayed_verify", "unified_schedule"),
    [
        ("pillar", None, None, None, False),
        ("pillar", None, True, None, False),
        ("pillar", False, None, None, False),
        ("pillar", None, None, True, False),
        ("pillar", None, None, True, True),
        ("ngram", None, None, None, False),
        ("query_sketch", None, None, None, False),
    ],
    ids=["pillar", "pillar-graphs", "pillar-stepwise", "pillar-delayed", "pillar-unified-delayed", "ngram", "sketch"],
)
def test_speculative_sampling_is_lossless(draft, draft_chain, cuda_graphs, delayed_verify, unified_schedule, sampling):
    """Speculative decoding samples exactly the target distribution: 1200 samples of the first 4 tokens from one
    prompt (token 1 from the prefill, tokens 2-3 drafted and verified, token 4 a bonus or a new round), each
    token and each adjacent pair against the exact distribution, and tokens 1 and 1-2 against draft=None samples
    (two-sample chi-square). Bonferroni over the 9 comparisons. The query sketch's drafts choose their positions
    inside attention, chained. PillarAttn runs both ways: a round's drafts
    chained in one step (sampled on the device, each fed to the next forward), the same through the padded
    static path of CUDA graphs (its chain graph samples temperature-only settings itself), one draft per step, and
    with delayed verification (the batch's halves alternate, each launched while the other is read back), and so
    under the unified schedule (each request's first round cut to spread the rounds over their phases).

    The rejection rate must be strictly between 0 and 1 (pillar with min_budget=4 attends to ~4 of 12+
    positions; n-gram proposals come from the prompt's repeats), else acceptance or rejection goes untested.
    """
    tokens, stats = sampled_tokens(draft, sampling, draft_chain, delayed_verify, cuda_graphs, unified_schedule)
    plain, _ = sampled_tokens(None, sampling)
    rejection_rate = 1 - stats.num_accepted_tokens / max(1, stats.num_draft_tokens)
    assert stats.num_rounds >= NUM_SAMPLES // 2, f"only {stats.num_rounds} speculation rounds"
    assert 0.05 < rejection_rate < 0.95, f"rejection rate {rejection_rate:.3f}"
    counts, plain_counts = count_table(tokens, VOCAB), count_table(plain, VOCAB)
    p_values = _p_values_against_exact(counts, exact_joint(sampling))
    p_values["t1 vs draft=None"] = two_sample(counts.sum((1, 2, 3)), plain_counts.sum((1, 2, 3)))
    p_values["t1t2 vs draft=None"] = two_sample(counts.sum((2, 3)), plain_counts.sum((2, 3)))
    assert_p_values(
        p_values,
        f"{draft} chain={draft_chain} graphs={cuda_graphs} delayed={delayed_verify} unified={unified_schedule} "
        f"{sampling} ({stats.num_rounds} "
        f"rounds, "
        f"rejection rate {rejection_rate:.3f})",
    )


LONG_TOKENS = 9  # past the first rounds: later ones launch ahead of a round in flight


@functools.cache
def plain_long_tokens(sampling: str) -> torch.Tensor:
    """``[NUM_SAMPLES, LONG_TOKENS]`` tokens sampled by the engine without speculation from PROMPT."""
    plain_run = generate(
        _wrap(None, NUM_SAMPLES, PROMPT, LONG_TOKENS), 22, PROMPT, NUM_SAMPLES, LONG_TOKENS, **SAMPLING[sampling]
    )
    return torch.tensor([o.token_ids for o in plain_run])


def _later_repeats(tokens: torch.Tensor) -> torch.Tensor:
    """Per sample, how many of tokens 5-9 repeat one generated before them: what a repetition penalty that
    missed some tokens (a round's accepted drafts, say) would raise."""
    earlier = tokens[:, None, :] == tokens[:, NEW_TOKENS:, None]  # [N, later, all]: later token i equals token j
    before = torch.arange(LONG_TOKENS)[None, :] < torch.arange(NEW_TOKENS, LONG_TOKENS)[:, None]
    return (earlier & before).any(dim=-1).sum(dim=-1)


def _p_values_of_later_tokens(tokens: torch.Tensor, sampling: str) -> dict[str, float]:
    """Each of tokens 5-9 (past the exact joint's reach), the pair (8, 9) and the number of them that repeat an
    earlier token against draft=None's samples."""
    plain = plain_long_tokens(sampling)
    p_values = {
        f"t{i + 1}": two_sample(count_table(tokens[:, i : i + 1], VOCAB), count_table(plain[:, i : i + 1], VOCAB))
        for i in range(NEW_TOKENS, LONG_TOKENS)
    }
    p_values["t8t9"] = two_sample(count_table(tokens[:, 7:9], VOCAB), count_table(plain[:, 7:9], VOCAB))
    repeats = [torch.bincount(_later_repeats(t), minlength=LONG_TOKENS - NEW_TOKENS + 1) for t in (tokens, plain)]
    p_values["repeats in t5-t9"] = two_sample(*repeats)
    return p_values


@pytest.mark.parametrize("cuda_graphs", [None, True], ids=["dynamic", "graphs"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_rounds_ahead_sample_the_plain_distribution(sampling, cuda_graphs, monkeypatch):
    """Rounds launched while the request's last round is in flight start where only the device knows (the host
    assumes every draft of the round in flight accepted): their positions, lists, stop-token masks and
    rejection sampling must still give the target distribution. 1200 samples of 9 tokens with rounds ahead
    against draft=None's: each of tokens 5-9 (made by rounds launched ahead), the pair (8, 9) and how many of
    them repeat an earlier token, two-sample chi-square, Bonferroni over the 7 comparisons; the run must have
    launched rounds ahead, with drafts both accepted and rejected."""
    wrapped = _wrap("pillar", NUM_SAMPLES, PROMPT, LONG_TOKENS, delayed_verify=True, cuda_graphs=cuda_graphs)
    assert wrapped.engine.rounds_ahead
    runner, launch, bound = wrapped.engine.runner, wrapped.engine.runner.launch, []
    monkeypatch.setattr(
        runner, "launch", lambda plan: bound.append(sum(i.bound for i in plan.scheduled)) or launch(plan)
    )
    ahead = torch.tensor(
        [o.token_ids for o in generate(wrapped, 21, PROMPT, NUM_SAMPLES, LONG_TOKENS, **SAMPLING[sampling])]
    )
    stats = wrapped.last_stats
    assert sum(bound) >= NUM_SAMPLES, f"only {sum(bound)} rounds launched ahead"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p_values = _p_values_of_later_tokens(ahead, sampling)
    assert_p_values(p_values, f"rounds ahead {sampling} graphs={cuda_graphs} ({sum(bound)} launched ahead)")


@pytest.mark.parametrize(
    ("draft_chain", "cuda_graphs"), [(None, None), (False, None), (None, True)], ids=["chain", "stepwise", "graphs"]
)
def test_drafts_reading_every_position_penalise_as_their_verify(draft_chain, cuda_graphs):
    """A draft budget covering the context makes each draft forward the target's own, so with a repetition
    penalty and min_p its distribution equals its verify row's bit for bit (the same tokens penalised, the
    round's earlier drafts included, the same min-p cut), and rejection sampling accepts every draft: chained
    (later drafts sampled on the device), one draft per step, and on the chain graph's padded path. Every draft
    accepted, the tokens are the verifies': the first 4 (each and adjacent pairs) against the exact
    distribution, tokens 5-9 (rounds after accepted drafts, whose penalty holds them) against draft=None's
    samples; Bonferroni over the 14 comparisons."""
    wrapped = _wrap("pillar", NUM_SAMPLES, PROMPT, LONG_TOKENS, draft_chain, cuda_graphs=cuda_graphs, min_budget=64)
    outputs = generate(wrapped, 23, PROMPT, NUM_SAMPLES, LONG_TOKENS, **SAMPLING[PENALISED])
    stats = wrapped.last_stats
    assert stats.num_draft_tokens >= NUM_SAMPLES * K and stats.num_accepted_tokens == stats.num_draft_tokens
    tokens = torch.tensor([o.token_ids for o in outputs])
    p_values = _p_values_against_exact(count_table(tokens[:, :NEW_TOKENS], VOCAB), exact_joint(PENALISED))
    assert_p_values(p_values | _p_values_of_later_tokens(tokens, PENALISED), f"dense drafts, chain={draft_chain}")


# -- min_new_tokens and EOS --------------------------------------------------------------------------------------

EOS_ID = 4  # probability 0.32 right after EOS_PROMPT: without suppression EOS would often come first
EOS_PROMPT = [4, 6, 4, 5, 4, 3, 4, 12]  # EOS_ID after several tokens: n-gram lookups often propose it early
MIN_NEW_TOKENS = 3
EOS_SAMPLES = 400
EOS_MAX_NEW_TOKENS = 6


@pytest.mark.parametrize("draft", [None, "pillar", "ngram"])
def test_min_new_tokens_and_eos_with_sampling(draft):
    """With sampling and speculation, EOS is never emitted before min_new_tokens, a request stops at its first
    EOS after that, and the first 4 tokens (each and adjacent pairs) follow the exact distribution with EOS
    suppressed at the first 3 (Bonferroni over 7). n-gram lookups propose EOS before min_new_tokens (counted
    here), and those proposals must be rejected.

    EOS has probability 0.32 right after the prompt (checked), so a suppression bug shows within 400 samples.
    """
    unconstrained = exact_joint("t1", tuple(EOS_PROMPT)).sum(dim=(1, 2, 3))
    assert unconstrained[EOS_ID] > 0.2, "EOS is not likely enough after the prompt to test its suppression"
    wrapped = _wrap(draft, EOS_SAMPLES, EOS_PROMPT, EOS_MAX_NEW_TOKENS)
    early_eos_proposals = 0
    if draft == "ngram":
        policy = wrapped.engine.policy
        propose = policy.propose

        def recording_propose(request, max_tokens):
            nonlocal early_eos_proposals
            tokens = propose(request, max_tokens)
            early = tokens[: max(0, MIN_NEW_TOKENS - request.num_output_tokens)]
            early_eos_proposals += EOS_ID in early
            return tokens

        policy.propose = recording_propose
    outputs = generate(
        wrapped,
        {None: 3, "pillar": 4, "ngram": 5}[draft],
        EOS_PROMPT,
        EOS_SAMPLES,
        EOS_MAX_NEW_TOKENS,
        min_new_tokens=MIN_NEW_TOKENS,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )
    stopped = 0
    for output in outputs:
        tokens = output.token_ids
        assert EOS_ID not in tokens[:MIN_NEW_TOKENS], f"EOS before min_new_tokens: {tokens}"
        if EOS_ID in tokens:
            assert tokens.index(EOS_ID) == len(tokens) - 1 and output.finish_reason == "stop", tokens
            stopped += 1
        else:
            assert len(tokens) == EOS_MAX_NEW_TOKENS and output.finish_reason == "length", tokens
    assert stopped > 0, "no request ever stopped at EOS"
    if draft is not None:
        assert wrapped.last_stats.num_rounds > 0
    if draft == "ngram":
        assert early_eos_proposals > 0, "n-gram lookup never proposed EOS before min_new_tokens"
    # EOS comes at index MIN_NEW_TOKENS at the earliest, so every output has NEW_TOKENS (4) tokens to compare
    tokens = torch.tensor([o.token_ids[:NEW_TOKENS] for o in outputs])
    suppressed = exact_joint("t1", tuple(EOS_PROMPT), MIN_NEW_TOKENS, EOS_ID)
    assert_p_values(_p_values_against_exact(count_table(tokens, VOCAB), suppressed), f"draft={draft}")
