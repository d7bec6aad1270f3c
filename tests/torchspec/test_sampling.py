"""Tests of token selection: warpers bit-exact with transformers', greedy/sampled rows, stop-token suppression.

The expected warped logits always come from transformers' own ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper``, applied in that order to one row at a
time, each only when transformers itself would apply it (temperature != 1, top_k > 0, top_p < 1, min_p set;
torchspec's min_p of 0 is transformers' None).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from attention import reference
from torchspec.request import SamplingParams
from torchspec.sampling import (
    DenseProbs,
    WarpedLogits,
    sample_tokens,
    suppress_stop_tokens,
    target_probs,
    warp_logits,
    warped_probs,
)

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 1000


def _hf_warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """transformers' warpers on a single ``[V]`` row, in transformers' order and with its on/off rules."""
    scores = row[None].clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores[0]


# Per-row warper parameters: (temperature, top_k, top_p), or (temperature, top_k, top_p, min_p).
Params = tuple[float, int, float] | tuple[float, int, float, float]


def _warp(logits: torch.Tensor, params: list[Params]) -> torch.Tensor:
    """warp_logits with per-row parameters, built the way sample_tokens builds them."""
    min_p = torch.tensor([p[3] if len(p) > 3 else 0.0 for p in params], dtype=torch.float32)
    return warp_logits(
        logits.clone(),
        torch.tensor([p[0] for p in params], dtype=torch.float32),
        torch.tensor([p[1] for p in params], dtype=torch.int64),
        torch.tensor([p[2] for p in params], dtype=torch.float64),
        max_top_k=max(p[1] for p in params),
        min_p=min_p if min_p.any() else None,
    )


def _assert_rows_match_transformers(logits: torch.Tensor, params: list[Params]) -> None:
    warped = _warp(logits, params)
    assert warped.shape == logits.shape and warped.dtype == torch.float32
    for row, param in enumerate(params):
        expected = _hf_warp(logits[row], *param)
        assert torch.equal(warped[row], expected), (
            f"row {row} (temperature, top_k, top_p[, min_p] = {param}): "
            f"{int((warped[row] != expected).sum())} entries differ; "
            f"kept {int(torch.isfinite(warped[row]).sum())} vs transformers {int(torch.isfinite(expected).sum())}"
        )


def _random_logits(rows: int, seed: int, vocab: int = VOCAB, std: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * std


PARAM_SETS = [
    (1.0, 0, 1.0),  # no warping at all
    (0.7, 0, 1.0),
    (1.6, 0, 1.0),
    (1.0, 50, 1.0),
    (1.0, 1, 1.0),
    (1.0, 5000, 1.0),  # top_k above the vocabulary size
    (1.0, 0, 0.9),
    (1.0, 0, 0.5),
    (0.7, 50, 0.9),
    (1.3, 10, 0.3),
    (0.5, 200, 0.95),
    (0.9, 999, 0.99),
    (1.0, VOCAB, 0.8),
    (0.8, 0, 1e-9),  # 1 - top_p rounds to 1 in fp32: only the most likely token may survive
    (1.0, 0, 1.0, 0.1),
    (0.7, 0, 1.0, 0.02),
    (1.0, 50, 1.0, 0.2),
    (0.7, 50, 0.9, 0.05),  # min_p after top-k and top-p: its top probability is renormalised over what they keep
    (1.3, 10, 0.3, 0.5),
    (1.0, 0, 1.0, 1.0),  # only tokens as likely as the most likely one
]


@pytest.mark.parametrize("params", PARAM_SETS, ids=["-".join(map(str, p)) for p in PARAM_SETS])
def test_warp_matches_transformers(params):
    """Every row is bit-identical (incl. the -inf pattern) to transformers' warpers for one parameter set."""
    _assert_rows_match_transformers(_random_logits(8, seed=PARAM_SETS.index(params)), [params] * 8)


def test_warp_per_row_parameters():
    """Different parameters per row in one batch: each row equals transformers applied to that row alone."""
    params = [PARAM_SETS[i % len(PARAM_SETS)] for i in range(2 * len(PARAM_SETS))]
    _assert_rows_match_transformers(_random_logits(len(params), seed=1), params)


@pytest.mark.parametrize("grid", [0.5, 1.0])
def test_warp_with_tied_logits(grid):
    """Logits on a coarse grid (many ties at the top-k / top-p cut): ties are kept or dropped as transformers does."""
    logits = (_random_logits(48, seed=2) / grid).round() * grid
    assert len(torch.unique(logits[0])) < VOCAB // 20  # really many ties
    params = [(t, k, p, m) for t in (1.0, 0.8) for k in (0, 3, 20, 100) for p in (1.0, 0.9, 0.5) for m in (0.0, 0.3)]
    _assert_rows_match_transformers(logits, params)


def test_warp_with_tied_logits_small_vocab():
    """Small vocabularies where the top-k boundary and the top-p boundary fall inside a block of equal logits."""
    logits = torch.tensor(
        [
            [2.0, 1.0, 1.0, 1.0, 0.0, 0.0],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [3.0, 3.0, 1.0, 1.0, 1.0, -1.0],
            [0.0, 0.0, 0.0, 5.0, 0.0, 0.0],
        ]
    )
    for k in (0, 1, 2, 3, 4):
        for p in (1.0, 0.999, 0.9, 0.6, 0.5, 0.4, 0.2):
            _assert_rows_match_transformers(logits, [(1.0, k, p)] * 4)


def _rows_around(center: float) -> torch.Tensor:
    """Unique rows ``[d, 0, c]``: ``d`` swept over 60 fp32 steps either way from ``center``, and a tiny third logit
    ``c`` shifting the normaliser by sub-ulp amounts, so that probabilities take the fp32 values next to a cut."""
    rows = []
    for c in (-math.inf, -21.0, -20.0, -19.5, -19.0, -18.5, -18.0, -17.0):
        for direction in (math.inf, -math.inf):
            d = torch.tensor([center], dtype=torch.float32)
            for _ in range(60):
                rows.append([d.item(), 0.0, c])
                d = torch.nextafter(d, torch.tensor(direction))
    return torch.unique(torch.tensor(rows), dim=0)


@pytest.mark.parametrize("top_p", [0.6, 0.7, 0.8, 0.9, 0.95, 0.99])
def test_warp_top_p_boundary(top_p):
    """Cumulative probabilities on and a few fp32 ulps around 1 - top_p are cut exactly as transformers cuts them.

    Rows ``[d, 0, c]`` with ``d`` around log((1 - top_p) / top_p) make the cumulative probability take the fp32
    values next to 1 - top_p.
    """
    logits = _rows_around(math.log((1 - top_p) / top_p))
    cumulative = logits.sort(dim=-1).values.softmax(-1).cumsum(-1)[:, 1]
    threshold = torch.tensor(1 - top_p, dtype=torch.float32)
    assert (cumulative < threshold).any() and (cumulative == threshold).any() and (cumulative > threshold).any()
    _assert_rows_match_transformers(logits, [(1.0, 0, top_p)] * len(logits))


@pytest.mark.parametrize("min_p", [0.2, 0.3, 0.5, 0.75])
def test_warp_min_p_boundary(min_p):
    """Probabilities on and a few fp32 ulps around min_p times the most likely one are cut exactly as transformers
    cuts them: rows ``[d, 0, c]`` with ``d`` around log(min_p). Values chosen so that some probability lands
    exactly on the cut."""
    logits = _rows_around(math.log(min_p))
    probs = logits.softmax(-1)
    threshold = torch.tensor(min_p, dtype=torch.float32) * probs[:, 1]
    kinds = [(probs[:, 0] < threshold).any(), (probs[:, 0] == threshold).any(), (probs[:, 0] > threshold).any()]
    assert all(kinds), kinds
    _assert_rows_match_transformers(logits, [(1.0, 0, 1.0, min_p)] * len(logits))


@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_warp_top_p_off_keeps_negligible_tokens(temperature):
    """top_p = 1 disables top-p: tokens whose probability underflows to 0 in fp32 stay finite, as in transformers."""
    logits = torch.tensor([[0.0, -50.0, -120.0, -200.0, 1.0], [3.0, -3.0, 0.5, -2.5, 2.0]])
    _assert_rows_match_transformers(logits, [(temperature, 0, 1.0), (temperature, 0, 1.0)])


def test_warp_of_bf16_logits_matches_transformers_on_their_fp32_copy():
    """A bf16 model's logits go in as they are: the result is transformers' warping of their fp32 copy, bit for
    bit, ties at the k-th largest included (bf16 logits tie often; each row here holds a run of equal values
    across its top-k boundary, and its temperature is not a power of two)."""
    logits = _random_logits(4, seed=11).to(torch.bfloat16)
    logits[:, 100:108] = logits.float().topk(10, dim=-1).values[:, 6:7].to(torch.bfloat16)  # ties around rank 7
    params = [(0.65, 10, 1.0), (1.3, 8, 0.9), (0.7, 0, 0.8), (0.9, 12, 1.0)]
    warped = _warp(logits, params)
    assert warped.dtype == torch.float32
    for row, (t, k, p) in enumerate(params):
        assert torch.equal(warped[row], _hf_warp(logits[row].float(), t, k, p)), f"row {row}"


def test_warp_does_not_modify_its_input():
    """warp_logits returns a new tensor and leaves the caller's logits intact."""
    logits = _random_logits(4, seed=3)
    before = logits.clone()
    warp_logits(logits, torch.full((4,), 0.7), torch.full((4,), 5), torch.full((4,), 0.5), max_top_k=5)
    assert torch.equal(logits, before)


def test_greedy_rows_return_argmax():
    """do_sample=False (whatever the other parameters) and temperature 0 rows give the argmax of the raw logits."""
    logits = _random_logits(6, seed=4)
    params = [
        SamplingParams(),
        SamplingParams(do_sample=False, temperature=0.5, top_k=3, top_p=0.2),
        SamplingParams(do_sample=True, temperature=0.0),
        SamplingParams(do_sample=True, temperature=0.0, top_k=7, top_p=0.3),
        SamplingParams(do_sample=True, temperature=1.0),  # sampled: only checked to be a valid token
        SamplingParams(do_sample=False, temperature=2.0),
    ]
    expected = logits.argmax(dim=-1)
    for seed in range(5):
        tokens = sample_tokens(logits.clone(), params, torch.Generator().manual_seed(seed))
        assert tokens.shape == (6,) and tokens.dtype == torch.int64
        for row in (0, 1, 2, 3, 5):
            assert tokens[row] == expected[row]
        assert 0 <= int(tokens[4]) < VOCAB


def test_sampled_rows_with_top_k_one_return_argmax():
    """A sampled row with top_k=1 (or a vanishing top_p) can only produce the argmax, at any temperature."""
    logits = _random_logits(5, seed=5)
    params = [
        SamplingParams(do_sample=True, top_k=1),
        SamplingParams(do_sample=True, top_k=1, temperature=3.0),
        SamplingParams(do_sample=True, top_k=1, temperature=0.3, top_p=0.1),
        SamplingParams(do_sample=True, top_k=1, top_p=0.99),
        SamplingParams(do_sample=True, temperature=2.0, top_p=1e-9),
    ]
    for seed in range(20):
        tokens = sample_tokens(logits, params, torch.Generator().manual_seed(seed))
        assert torch.equal(tokens, logits.argmax(dim=-1))


def test_sampling_is_reproducible_with_a_generator():
    """The same generator seed gives the same tokens."""
    logits = _random_logits(16, seed=6)
    params = [SamplingParams(do_sample=True, temperature=1.2, top_p=0.95)] * 16
    first = sample_tokens(logits, params, torch.Generator().manual_seed(7))
    second = sample_tokens(logits, params, torch.Generator().manual_seed(7))
    assert torch.equal(first, second)


MAX_FREQUENCY_ERROR = 0.02  # ~5.7 standard errors for 20000 samples; fixed before looking at any result
DISTRIBUTION_CASES = [
    (1.0, 0, 1.0, 0.0),
    (0.8, 4, 1.0, 0.0),
    (1.5, 0, 0.8, 0.0),
    (0.7, 3, 0.9, 0.0),
    (1.0, 0, 1.0, 0.3),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", DISTRIBUTION_CASES)
def test_sampling_distribution_matches_warped_softmax(temperature, top_k, top_p, min_p):
    """20000 draws on a 5-token vocabulary follow softmax(transformers-warped logits); filtered tokens never drawn."""
    row = torch.tensor([1.0, 0.2, -0.5, 1.4, 0.6])
    n = 20000
    params = [SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * n
    tokens = sample_tokens(row.expand(n, 5).clone(), params, torch.Generator().manual_seed(8))
    frequencies = torch.bincount(tokens, minlength=5).double() / n
    expected = _hf_warp(row, temperature, top_k, top_p, min_p).double().softmax(-1)
    assert (frequencies[expected == 0] == 0).all()
    assert (frequencies - expected).abs().max() < MAX_FREQUENCY_ERROR, (frequencies, expected)


def test_suppress_stop_tokens():
    """Only the listed rows' stop ids become -inf; other entries and unlisted rows are untouched."""
    logits = _random_logits(4, seed=9, vocab=8)
    before = logits.clone()
    suppress_stop_tokens(logits, [0, 2, 3], [(1, 5), (7,), ()])
    expected = before.clone()
    expected[0, [1, 5]] = -math.inf
    expected[2, 7] = -math.inf
    assert torch.equal(logits, expected)


def test_suppressed_stop_tokens_are_never_sampled():
    """After suppression a stop token cannot be chosen, greedy or sampled, even when it is the argmax."""
    logits = torch.zeros(2, 4)
    logits[:, 2] = 10.0
    suppress_stop_tokens(logits, [0, 1], [(2,), (2,)])
    params = [SamplingParams(), SamplingParams(do_sample=True, temperature=2.0)]
    for seed in range(20):
        tokens = sample_tokens(logits, params, torch.Generator().manual_seed(seed))
        assert (tokens != 2).all()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.01},
        {"top_k": -1},
        {"max_new_tokens": -1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.3},
        {"min_p": -0.1},
        {"min_p": 1.5},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_validate_rejects_out_of_range(kwargs):
    """SamplingParams.validate raises ValueError for each out-of-range value."""
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"max_new_tokens": 0},
        {"repetition_penalty": 1e-3},
        {"min_p": 0.0},
        {"min_p": 1.0},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults",
)
def test_validate_accepts_boundary_values(kwargs):
    """The boundary values of each valid range pass validation."""
    SamplingParams(**kwargs).validate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_probs_without_top_p_are_the_warped_probabilities(dtype):
    """Verify targets kept as logits (temperature and top-k: one cut-off and log-normaliser per row) give, at any
    token and as whole rows, the probabilities ``warped_probs`` materialises: ties at the top-k cut-off kept
    (logits rounded to integers tie by the dozen), rows without top-k, a stop token suppressed to -inf.

    Protects rejection sampling's p after the verify stopped materialising [rows, V] probabilities."""
    logits = (_random_logits(5, seed=11) * 2).round().to(dtype)
    logits[2, 3] = float("-inf")
    params = [
        SamplingParams(temperature=0.65, top_k=50),
        SamplingParams(temperature=1.0, top_k=0),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0.4, top_k=1),
    ]
    owner = np.array([0, 1, 2, 3, 0])
    target = target_probs(logits, params, owner, reference)
    assert isinstance(target, WarpedLogits)
    expected = warped_probs(logits, params, owner)
    rows = torch.arange(5)
    whole = torch.arange(VOCAB).expand(5, VOCAB)
    torch.testing.assert_close(target.at(rows[:, None].expand_as(whole), whole), expected, rtol=1e-5, atol=1e-7)
    tokens = torch.randint(0, VOCAB, (5, 40), generator=torch.Generator().manual_seed(3))
    tokens[:, 0] = logits.float().topk(50, dim=-1).indices[:, -1]  # at the cut-off
    torch.testing.assert_close(target.at(rows[:, None].expand_as(tokens), tokens), expected.gather(1, tokens))
    kept = (expected > 0).sum(dim=-1)
    assert kept[0] > 50 and kept[1] == VOCAB and kept[3] >= 1, kept  # ties beyond top_k, an uncut row


@pytest.mark.parametrize("filtered", [{"top_p": 0.9}, {"min_p": 0.05}], ids=["top_p", "min_p"])
def test_target_probs_with_top_p_or_min_p_are_dense(filtered):
    """A row filtered by top-p needs its sorted vocabulary, and by min-p its normaliser: the targets are the dense
    warped probabilities."""
    logits = _random_logits(2, seed=12)
    params = [SamplingParams(temperature=0.7, top_k=20, **filtered), SamplingParams(temperature=1.0)]
    target = target_probs(logits, params, None, reference)
    assert isinstance(target, DenseProbs)
    torch.testing.assert_close(target.probs, warped_probs(logits, params))
