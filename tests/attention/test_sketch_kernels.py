"""The int4 key sketch's kernels against their reference, and the reference against its definition. Without CUDA
the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from attention import reference, sketch_kernels

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
@pytest.mark.parametrize(("group", "width"), [(3, 70), (1, 5), (8, 130), (2, 4400)])
def test_sketch_mass_matches_the_reference(dtype, group, width):
    """A row's candidates are a prefix of its positions, then listed ones, at its slot-table row's slots: each gets
    its group's mass; padding (-1 positions, unwritten slots) takes no part and gets -1, as do the first ``skip``
    entries, which still weigh in; entries past a row's candidates are left to the reader (``lengths``). A long
    row is scored in chunks (``MASS_CHUNK``), its normalisers merged ``MASS_CHUNKS_MERGED`` chunks at a time."""
    torch.manual_seed(1)
    heads, head_dim = 2, 64
    positions = max(150, width)
    num_slots = positions + 50
    k_cache = torch.randn(num_slots, heads, head_dim).to(dtype)
    codes, scales = _sketched(k_cache, torch.arange(num_slots), reference.store_key_sketch)
    table = torch.randint(num_slots, (5, positions))
    table[3, 40:] = -1  # a row whose later positions have no slot yet
    query = (3 * torch.randn(4, heads, group, head_dim)).to(dtype)
    rows = torch.tensor([2, 3, 0, 4])
    prefix = torch.tensor([width, width // 2, 0, 1]).clamp(max=positions)
    listed = torch.randint(positions, (5, heads, 6))  # by slot-table row
    listed[0, 1, 2:] = -1  # padding among listed positions
    listed_lengths = torch.tensor([0, min(6, width - width // 2), min(6, width), min(6, width - 1)])
    skip = torch.tensor([2, 0, 0, 1])
    args = (table, rows, prefix, listed, listed_lengths)
    expected = reference.sketch_mass(query, codes, scales, *args, 0.125, skip, width)
    on_device = [t.to(DEVICE) for t in (query, codes, scales, *args)]
    actual = sketch_kernels.sketch_mass(*on_device, 0.125, skip.to(DEVICE), width).cpu()
    inside = torch.arange(width) < (prefix + listed_lengths)[:, None, None]
    tolerance = 1e-5 if dtype == torch.float32 or DEVICE == "cpu" else 2e-3  # tf32 dots on a GPU
    torch.testing.assert_close(actual[inside.expand_as(actual)], expected[inside.expand_as(expected)],
                               rtol=tolerance, atol=tolerance)  # fmt: skip
    assert (expected[~inside.expand_as(expected)] == -1).all()
    # By definition: the group mass over the candidates' slots.
    index = torch.arange(width).expand(4, heads, width)
    candidates = reference.candidate_positions(prefix, listed, listed_lengths, index, rows)
    slots = torch.where(candidates >= 0, table[rows[:, None, None], candidates.clamp(min=0)], -1)
    logits = reference.sketch_logits(query, codes, scales, slots.clamp(min=0)) * 0.125
    torch.testing.assert_close(expected, reference.group_mass(logits, slots >= 0, skip))
    assert (expected[0, :, :2] == -1).all() and (expected[3, :, :1] == -1).all()
    if width > 40:
        assert (expected[1, :, 40 : width // 2] == -1).all()  # no slot: padding
    kept = expected.clamp(min=0)
    skipped_share = 1 - kept.sum(dim=-1)  # what the skipped entries took of each group's attention
    assert (skipped_share[0] > 0).all() and torch.allclose(skipped_share[2], torch.zeros(heads), atol=1e-5)


def test_candidate_positions_are_a_prefix_then_listed_positions():
    listed = torch.tensor([[[-1, 4, 5]], [[0, 0, 0]], [[7, 9, -1]]])  # by slot-table row, the last entries listed
    index = torch.tensor([[[0, 2, 3, 4, 5, -1]], [[0, 1, 2, 3, 4, 5]]])
    rows = torch.tensor([2, 0])
    actual = reference.candidate_positions(torch.tensor([3, 0]), listed, torch.tensor([3, 2]), index, rows)
    assert actual.tolist() == [[[0, 2, 7, 9, -1, -1]], [[4, 5, -1, -1, -1, -1]]]


def test_the_stored_sketch_scores_keys_quantised_on_the_fly():
    """The logits of the stored codes equal those of the keys quantised by the same rule (a key's largest
    magnitude over ``SKETCH_LEVELS`` as its scale, channels rounded), and approximate the exact ones."""
    torch.manual_seed(2)
    k_cache = torch.randn(50, 3, 32)
    codes, scales = _sketched(k_cache, torch.arange(50), reference.store_key_sketch)
    query, positions = torch.randn(2, 3, 4, 32), torch.randint(50, (2, 3, 9))
    keys = k_cache[positions, torch.arange(3)[None, :, None]]
    scale = keys.abs().amax(dim=-1, keepdim=True) / reference.SKETCH_LEVELS
    quantised = (keys / scale).round().clamp(-reference.SKETCH_LEVELS, reference.SKETCH_LEVELS) * scale
    actual = reference.sketch_logits(query, codes, scales, positions)
    torch.testing.assert_close(actual, torch.einsum("nhgd,nhsd->nhgs", query, quantised))
    exact = torch.einsum("nhgd,nhsd->nhgs", query, keys)
    assert torch.corrcoef(torch.stack([actual.flatten(), exact.flatten()]))[0, 1] > 0.98


def _by_definition(picks, table, rows, prefix, listed, listed_lengths, sinks, recent_start, recent, span):
    """Each request's list, position by position: sinks, recent positions, then each pick that is no sink and each
    of its successors before the recent start and the next pick."""
    lists = []
    for i in range(picks.shape[0]):
        heads = []
        for h in range(picks.shape[1]):
            valid = [int(p) for p in picks[i, h] if p >= 0]
            rows_listed = listed[rows[i], h, listed.shape[-1] - int(listed_lengths[i]) :].tolist()
            bases = [p if p < prefix[i] else rows_listed[p - prefix[i]] for p in valid]
            bases = [-1 if p < sinks[i] else base for p, base in zip(valid, bases, strict=True)]
            entries = list(range(int(sinks[i]))) + list(range(int(recent_start[i]), int(recent_start[i] + recent[i])))
            for j, base in enumerate(bases):
                after = bases[j + 1] if j + 1 < len(bases) and bases[j + 1] >= 0 else None
                for step in range(span):
                    kept = base >= 0 and base + step < recent_start[i] and (after is None or base + step < after)
                    entries.append(base + step if kept else -1)
            heads.append([int(table[rows[i], e]) if e >= 0 else -1 for e in entries])
        lists.append(heads)
    return lists


@pytest.mark.parametrize("span", [1, 3])
def test_sketch_lists_match_the_reference_and_its_definition(span):
    """Sinks, recent positions, then the picks (a prefix's indices as positions, listed ones mapped through the
    row's last listed entries) with their successors; a picked sink and successors reaching the recent positions
    or the next pick are padding; every list ends where its entries do."""
    torch.manual_seed(3)
    positions, heads, width = 60, 2, 40
    table = torch.randperm(400)[: 4 * positions].view(4, positions)
    rows = torch.tensor([3, 1, 0])
    prefix = torch.tensor([30, 2, 2])  # a first choice (a prefix of 30 older positions), two rescoring shortlists
    listed = torch.full((4, heads, 8), -1)
    listed[1, :, 4:] = torch.tensor([[5, 9, 10, 20], [6, 7, 12, 25]])
    listed[0, :, 5:] = torch.tensor([[3, 8, 21], [4, 11, 13]])
    listed_lengths = torch.tensor([0, 4, 3])
    sinks = torch.tensor([2, 2, 2])
    recent_start = torch.tensor([30, 28, 22])
    recent = torch.tensor([5, 3, 9])
    picks = torch.tensor([  # as many picks in every head of a request (as a Top-K makes them)
        [[-1, 1, 5, 6, 29], [-1, 9, 10, 11, 28]],  # a sink picked (1), successors reaching the recent start
        [[-1, 2, 3, 4, 5], [-1, 0, 2, 4, 5]],  # shortlist entries (2 -> 5, ...), a sink (0)
        [[-1, -1, -1, 2, 4], [-1, -1, -1, 0, 3]],
    ], dtype=torch.int32)  # fmt: skip
    args = (table, rows, prefix, listed, listed_lengths, sinks, recent_start, recent, span, width)
    slots, ends = reference.sketch_lists(picks, *args)
    expected = _by_definition(picks, *args[:-1])
    for i, per_head in enumerate(expected):
        for h, entries in enumerate(per_head):
            row = slots[h, i * width : (i + 1) * width]
            assert row[: len(entries)].tolist() == entries
            assert (row[int(ends[i]) - i * width :] == -1).all()
        assert int(ends[i]) - i * width == len(per_head[0])
    on_device = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (picks, *args)]
    actual = sketch_kernels.sketch_lists(*on_device)
    assert torch.equal(actual[0].cpu(), slots) and torch.equal(actual[1].cpu(), ends)
