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
