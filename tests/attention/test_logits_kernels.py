"""The logits kernels against their reference. Without CUDA they run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from attention import logits_kernels, reference

pytestmark = pytest.mark.usefixtures("single_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab_size", [300, 5000])  # one block, and a loop over blocks with a ragged end
def test_warped_lse(dtype, vocab_size):
    """Rows cut at their 1st, 3rd and 40th largest logit (ties at the cut-off included: logits rounded to a
    coarse grid), uncut rows, and a row whose stop tokens are -inf."""
    torch.manual_seed(4)
    logits = (torch.randn(6, vocab_size) * 4).round().to(dtype)  # integers: many ties
    logits[5, :7] = float("-inf")
    temperature = torch.tensor([0.65, 1.0, 1.7, 0.3, 1.0, 0.9])
    kth = logits.float().topk(40, dim=-1).values
    cutoff = torch.stack([kth[0, 0], kth[1, 2], kth[2, 39], kth[3, 2], kth[4, 0], kth[5, 39]]) / temperature
    cutoff[4] = float("-inf")
    expected = reference.warped_lse(logits, temperature, cutoff)
    actual = logits_kernels.warped_lse(logits.to(DEVICE), temperature.to(DEVICE), cutoff.to(DEVICE))
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_reference_is_the_log_normaliser_of_warped_probabilities():
    """``exp(scaled - lse)`` over the kept entries is the softmax of the masked scaled logits."""
    torch.manual_seed(5)
    logits = torch.randn(3, 50)
    temperature = torch.tensor([0.5, 1.0, 2.0])
    cutoff = logits.topk(5, dim=-1).values[:, -1] / temperature
    scaled = logits / temperature[:, None]
    masked = scaled.masked_fill(scaled < cutoff[:, None], float("-inf"))
    lse = reference.warped_lse(logits, temperature, cutoff)
    torch.testing.assert_close(torch.exp(masked - lse[:, None]), masked.softmax(dim=-1))


def _warped(logits: torch.Tensor, temperature: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cut-off at its ``kept``-th largest logit (scaled), and its warped probabilities."""
    cutoff = logits.float().topk(kept, dim=-1).values[:, -1] / temperature
    scaled = logits / temperature[:, None]
    return cutoff, scaled.masked_fill(scaled < cutoff[:, None], float("-inf")).softmax(dim=-1)


@pytest.mark.parametrize("implementation", ["kernel", "reference"])
def test_warped_sample_draws_the_warped_distribution(implementation):
    """Draws from three distributions (several draws a row: each its own noise) against their exact warped
    probabilities: a row cut at its 6th largest logit with a tie at the cut-off (7 tokens kept), one at T=0.3,
    one uncut with -inf entries (stop tokens: never drawn). A fixed seed: the p-values are the same every run."""
    from tests.torchspec.test_speculative_sampling import assert_p_values, goodness_of_fit

    torch.manual_seed(6)
    logits = torch.randn(3, 300) * 2
    logits[0, 7] = logits[0].topk(6).values[-1]  # ties the cut-off
    logits[2, :50] = float("-inf")
    temperature = torch.tensor([0.65, 0.3, 1.0])
    cutoff, probs = _warped(logits, temperature, 6)
    cutoff[2] = float("-inf")
    probs[2] = (logits[2] / temperature[2]).softmax(dim=-1)
    assert int((probs[0] > 0).sum()) == 7
    draws = 100 if implementation == "kernel" else 20_000  # the interpreter runs a program per draw and chunk
    rows = torch.arange(3).repeat_interleave(draws)
    sample = logits_kernels.warped_sample if implementation == "kernel" else reference.warped_sample
    seed = torch.tensor([1234], device=DEVICE)
    tokens = sample(logits.to(DEVICE), rows.to(DEVICE), temperature.to(DEVICE), cutoff.to(DEVICE), seed).cpu()
    assert tokens.dtype == torch.int64 and tokens.shape == rows.shape
    counts = [torch.bincount(tokens[rows == row], minlength=300) for row in range(3)]
    assert_p_values({f"row {row}": goodness_of_fit(counts[row], probs[row]) for row in range(3)}, implementation)


def test_warped_sample_finds_the_best_of_every_chunk():
    """Over SmolLM2's vocabulary a draw is searched in chunks by separate programs: rows keeping one token each,
    in the first chunk, a middle one and the ragged last, are drawn exactly (bf16 logits, rows read through an
    index, one of them twice)."""
    vocab = 49152 + 300
    logits = torch.zeros(3, vocab)
    winners = torch.tensor([5, 20_000, vocab - 1])
    logits[torch.arange(3), winners] = 8.0
    logits = logits.to(torch.bfloat16 if DEVICE == "cuda" else torch.float16)
    rows = torch.tensor([2, 0, 1, 2])
    temperature, cutoff = torch.tensor([0.65, 1.0, 2.0]), torch.tensor([10.0, 7.0, 3.0])  # 8 / T kept, 0 not
    args = [t.to(DEVICE) for t in (logits, rows, temperature, cutoff, torch.tensor([7]))]
    assert logits_kernels.warped_sample(*args).cpu().tolist() == winners[rows].tolist()
    assert reference.warped_sample(*args).cpu().tolist() == winners[rows].tolist()


@pytest.mark.parametrize("implementation", ["kernel", "reference"])
def test_warped_sample_less_a_draft_distribution(implementation):
    """Rejection sampling's correction: draws from ``max(p - q, 0)`` normalised against the exact residuals (q a
    point mass on p's likeliest token, and a random distribution over the whole vocabulary), from p where no q is
    given (-1), and from p where q covers p everywhere (no residual mass left)."""
    from tests.torchspec.test_speculative_sampling import assert_p_values, goodness_of_fit

    torch.manual_seed(7)
    vocab = 300
    logits = torch.randn(2, vocab) * 2
    temperature = torch.tensor([0.65, 1.0])
    cutoff, probs = _warped(logits, temperature, 6)
    cutoff[1] = float("-inf")
    probs[1] = (logits[1] / temperature[1]).softmax(dim=-1)
    lse = reference.warped_lse(logits, temperature, cutoff)
    minus = torch.stack([torch.zeros(vocab), 2 * probs[1], torch.randn(vocab).softmax(dim=-1)])
    minus[0, probs[0].argmax()] = 1.0
    residual = (probs[[0, 1]] - minus[[0, 2]]).clamp(min=0)
    expected = [probs[0], residual[0] / residual[0].sum(), probs[1], residual[1] / residual[1].sum()]
    draws = 80 if implementation == "kernel" else 20_000  # the interpreter runs a program per draw and chunk
    group = torch.arange(4).repeat_interleave(draws)
    rows, minus_rows = torch.tensor([0, 0, 1, 1])[group], torch.tensor([-1, 0, 1, 2])[group]
    sample = logits_kernels.warped_sample if implementation == "kernel" else reference.warped_sample
    args = [t.to(DEVICE) for t in (logits, rows, temperature, cutoff, torch.tensor([99]), lse, minus, minus_rows)]
    tokens = sample(*args).cpu()
    counts = [torch.bincount(tokens[group == g], minlength=vocab) for g in range(4)]
    assert counts[1][probs[0].argmax()] == 0  # the point mass's token is spent
    assert_p_values({f"draw {g}": goodness_of_fit(counts[g], expected[g]) for g in range(4)}, implementation)
