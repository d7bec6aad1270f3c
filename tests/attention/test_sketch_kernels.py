"""The int4 key sketch's kernels against their reference, and the reference against the sketch the acceptance
study scored from full keys. Without CUDA the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from attention import reference, sketch_kernels
from torchspec.key_sketch import KEY_SKETCHES

pytestmark = pytest.mark.usefixtures("single_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _sketched(k_cache: torch.Tensor, slots: torch.Tensor, store) -> tuple[torch.Tensor, torch.Tensor]:
    num_slots, heads, dim = k_cache.shape
    codes = torch.zeros(num_slots, heads, dim // 2, dtype=torch.uint8, device=k_cache.device)
    scales = torch.zeros(num_slots, heads, device=k_cache.device)
    store(k_cache, slots, codes, scales)
    return codes, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 40])
def test_store_writes_the_reference_codes_at_the_slots_only(dtype, head_dim):
    torch.manual_seed(0)
    k_cache = (torch.randn(30, 3, head_dim) * 3).to(dtype)
    k_cache[4, 1] = 0.0  # an all-zero key: scale at its floor, every code zero
    k_cache[7, 0] = 0.0  # exact halves (scale 1): rounded to even
    k_cache[7, 0, :6] = torch.tensor([3.5, -3.5, 7.0, 0.5, 2.5, -1.5])
    slots = torch.tensor([7, 4, 20, 3, 11])
    expected = _sketched(k_cache, slots, reference.store_key_sketch)
    actual = _sketched(k_cache.to(DEVICE), slots.to(DEVICE), sketch_kernels.store_key_sketch)
    assert torch.equal(actual[0].cpu(), expected[0])
    torch.testing.assert_close(actual[1].cpu(), expected[1], rtol=0, atol=0)
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[slots] = False
    assert not expected[0][untouched].any() and not expected[1][untouched].any()
    codes = [(low + 8) | ((high + 8) << 4) for low, high in [(4, -4), (7, 0), (2, -2)]]
    assert expected[1][7, 0] == 1.0 and expected[0][7, 0, :3].tolist() == codes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "length"), [(3, 70), (1, 5), (8, 130)])
def test_sketch_mass_matches_the_reference(dtype, group, length):
    """Padding (-1 slots) takes no part and gets -1, as do the first ``skip`` entries, which still weigh in."""
    torch.manual_seed(1)
    heads, head_dim, num_slots = 2, 64, 200
    k_cache = torch.randn(num_slots, heads, head_dim).to(dtype)
    codes, scales = _sketched(k_cache, torch.arange(num_slots), reference.store_key_sketch)
    query = (3 * torch.randn(3, heads, group, head_dim)).to(dtype)
    slots = torch.randint(num_slots, (3, heads, length))
    slots[1, :, length // 2 :] = -1
    slots[2, 1] = -1  # a row of padding only
    skip = torch.tensor([2, 0, 1])
    expected = reference.sketch_mass(query, codes, scales, slots, 0.125, skip)
    args = [t.to(DEVICE) for t in (query, codes, scales, slots)]
    actual = sketch_kernels.sketch_mass(*args, 0.125, skip.to(DEVICE)).cpu()
    tolerance = 1e-5 if dtype == torch.float32 or DEVICE == "cpu" else 2e-3  # tf32 dots on a GPU
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
    assert (expected[1, :, length // 2 :] == -1).all() and (expected[2, 1] == -1).all()
    assert (expected[0, :, :2] == -1).all() and (expected[2, 0, :1] == -1).all()
    kept = expected.clamp(min=0)
    skipped_share = 1 - kept.sum(dim=-1)  # what the skipped entries took of each group's attention
    assert (skipped_share[0] > 0).all() and torch.allclose(skipped_share[1], torch.zeros(heads), atol=1e-5)


def test_the_stored_sketch_scores_what_the_study_scored_from_full_keys():
    """``KeySketch.logits`` (int4) quantises full keys on the fly by the same rule: same logits."""
    torch.manual_seed(2)
    k_cache = torch.randn(50, 3, 32)
    codes, scales = _sketched(k_cache, torch.arange(50), reference.store_key_sketch)
    query, positions = torch.randn(2, 3, 4, 32), torch.randint(50, (2, 3, 9))
    keys = k_cache[positions, torch.arange(3)[None, :, None]]
    torch.testing.assert_close(
        reference.sketch_logits(query, codes, scales, positions), KEY_SKETCHES["int4"].logits(query, keys, ())
    )
