"""The Top-K kernel against its reference, and the reference against its definition. Without CUDA the kernel runs
in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from attention import reference, select_kernels

pytestmark = pytest.mark.usefixtures("single_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _by_definition(values: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Each row sorted by value, largest first, equal values lowest position first; the first k positions in
    ascending order after ``max_k - k`` entries of -1."""
    rows = []
    counts = k.expand(values.shape[:-1]).flatten().tolist()
    for row, count in zip(values.reshape(-1, values.shape[-1]).tolist(), counts, strict=True):
        count = min(count, max_k, len(row))
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))
        rows.append([-1] * (max_k - count) + sorted(order[:count]))
    return torch.tensor(rows, dtype=torch.int32).view(*values.shape[:-1], max_k)


def _rows(dtype: torch.dtype, width: int) -> torch.Tensor:
    """Six rows: ties (integers on a coarse grid), a -inf run, a flat row, -0.0 next to 0.0, and plain noise."""
    torch.manual_seed(6)
    values = (torch.randn(6, width) * 4).round()
    values[1, : width // 3] = float("-inf")
    values[2] = 0.5  # every entry ties
    values[3, ::2] = -0.0
    values[3, 1::2] = 0.0
    values[5] = torch.randn(width)
    return values.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [300, 3000])  # a row in registers; a long row (lane maxima, gathered candidates)
def test_kernel_matches_reference(dtype, width):
    """Every row's k (0, 1, the full max_k, values between) and a max_k beyond some rows' k; leading dimensions
    with a strided k broadcast over them, as PillarAttn passes its per-request counts."""
    values = _rows(dtype, width)
    k = torch.tensor([40, 3, 17, 40, 0, 1])
    expected = reference.top_k_positions(values, k, 40)
    actual = select_kernels.top_k_positions(values.to(DEVICE), k.to(DEVICE), 40)
    assert torch.equal(actual.cpu(), expected)
    stacked = values.view(2, 3, width)
    strided = k[:3].repeat_interleave(2)[::2]  # a view with stride 2, read in place
    expected = reference.top_k_positions(stacked, strided, 24)
    actual = select_kernels.top_k_positions(stacked.to(DEVICE), strided.to(DEVICE), 24)
    assert torch.equal(actual.cpu(), expected)


def test_kernel_gathers_past_its_candidates():
    """A long row whose lane maxima bound admits more entries than the candidates hold (many ties just below the
    k-th largest) takes the whole-row search: same picks."""
    values = torch.zeros(2, 5000)
    values[0, ::7] = 1.0  # 715 entries tie at the largest value: k = 30 of them
    values[1, 4000:] = torch.arange(1000.0)
    k = torch.tensor([30, 30])
    expected = reference.top_k_positions(values, k, 30)
    assert torch.equal(select_kernels.top_k_positions(values.to(DEVICE), k.to(DEVICE), 30).cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_thousands_of_picks_a_row_search_the_whole_row(dtype):
    """More picks than half a block (a drained batch's drafts read most of their contexts, a query sketch's
    shortlist), more than a block too: the whole row is searched, the same picks, per-request counts broadcast as
    PillarAttn passes them."""
    values = _rows(dtype, 3000).view(2, 3, 3000)
    k = torch.tensor([700, 0, 513])
    expected = reference.top_k_positions(values, k, 700)
    assert torch.equal(select_kernels.top_k_positions(values.to(DEVICE), k.to(DEVICE), 700).cpu(), expected)
    assert (expected[:, 0] >= 0).sum() == 2 * 700 and (expected[:, 2] >= 0).sum() == 2 * 513
    k = torch.tensor([[1500], [1100]])
    expected = reference.top_k_positions(values, k, 1600)
    assert torch.equal(select_kernels.top_k_positions(values.to(DEVICE), k.to(DEVICE), 1600).cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_is_the_definition(dtype):
    values = _rows(dtype, 60)
    k = torch.tensor([12, 3, 12, 7, 0, 60])
    assert torch.equal(reference.top_k_positions(values, k, 12), _by_definition(values, k, 12))


@pytest.mark.parametrize("width", [300, 3000])
def test_lengths_bound_what_each_row_reads(width):
    """With ``lengths``, a row's entries from its length on are neither read (NaN there changes nothing) nor
    picked: the picks of the row cut to its length, k clamped to it; lengths broadcast over heads as k is."""
    values = _rows(torch.float32, width).view(2, 3, width)
    k = torch.tensor([[40], [25]])
    lengths = torch.tensor([[width // 2], [30]])
    garbage = values.clone()
    for row, length in enumerate(lengths.flatten().tolist()):
        garbage[row, :, length:] = float("nan")
    expected = reference.top_k_positions(values, k, 40, lengths)
    for row, length in enumerate(lengths.flatten().tolist()):
        cut = reference.top_k_positions(values[row, :, :length], k[row], 40)
        assert torch.equal(expected[row], cut)
    actual = select_kernels.top_k_positions(garbage.to(DEVICE), k.to(DEVICE), 40, lengths.to(DEVICE))
    assert torch.equal(actual.cpu(), expected)
    wide = select_kernels.top_k_positions(garbage.to(DEVICE), k.to(DEVICE) * 20, 800, lengths.to(DEVICE))
    assert torch.equal(wide.cpu(), reference.top_k_positions(values, k * 20, 800, lengths))


@pytest.mark.parametrize("width", [300, 3000])
def test_leading_columns_of_a_wider_tensor_are_read_in_place(width):
    """PillarAttn's candidates are the first columns of the verify mass: the kernel reads such a view where it
    lies (the columns past it hold NaN, which a copy would carry along but nothing reads) and picks as from a
    contiguous copy, as it does a slice of rows of the mass; rows it cannot find by two strides are copied first."""
    values = _rows(torch.float32, width).view(2, 3, width)
    padded = torch.full((2, 3, width + 37), float("nan"))
    padded[..., :width] = values
    k = torch.tensor([40, 25, 9])
    expected = reference.top_k_positions(values, k, 40)
    on_device = padded.to(DEVICE)
    assert select_kernels._row_strides(on_device[..., :width]) == (3, 3 * (width + 37), width + 37)
    assert torch.equal(select_kernels.top_k_positions(on_device[..., :width], k.to(DEVICE), 40).cpu(), expected)
    assert select_kernels._row_strides(on_device[:, 1:, :width]) == (2, 3 * (width + 37), width + 37)
    rows = select_kernels.top_k_positions(on_device[:, 1:, :width], k[1:].to(DEVICE), 40)
    assert torch.equal(rows.cpu(), expected[:, 1:])
    four = torch.full((2, 4, 3, width + 37), float("nan"), device=DEVICE)
    four[:, :2, :, :width] = values.to(DEVICE)[:, None]
    assert select_kernels._row_strides(four[:, :2, :, :width]) is None  # (2, 2) groups not evenly spaced: a copy
    copied = select_kernels.top_k_positions(four[:, :2, :, :width], k.to(DEVICE), 40)
    assert torch.equal(copied.cpu(), expected[:, None].expand(2, 2, 3, 40))
