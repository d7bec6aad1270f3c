"""The draft-probs store: distributions kept as their support or as whole rows, grown without losing any."""

from __future__ import annotations

import torch

from torchspec.draft_probs import DraftProbsStore, KeptDistributions

VOCAB = 7


def _dense(kept: KeptDistributions, rows: int) -> torch.Tensor:
    """``[rows, k, VOCAB]``: the first ``rows`` rows' distributions as rows of the vocabulary."""
    dense, index = kept.dense(torch.arange(rows * kept.columns), VOCAB)
    return dense[index].view(rows, kept.columns, VOCAB)


def _write_supports(kept: KeptDistributions) -> torch.Tensor:
    """Rows 0 and 1 draw from supports of 2 tokens (row 1's includes token 0, which padding repeats); returns
    the distributions as dense rows."""
    rows, columns = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1])
    tokens = torch.tensor([[3, 5], [0, 6], [4, 0]])
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.875, 0.125]])
    kept.write(rows, columns, probs, tokens, probs[:, 0])
    expected = torch.zeros(2, 3, VOCAB)
    expected[rows[:, None], columns[:, None], tokens] = probs
    return expected


def test_supports_are_kept_narrow_and_read_as_rows():
    store = DraftProbsStore(k=3, device=torch.device("cpu"))
    kept = store.reserve(2, VOCAB, support=2)
    assert kept.tokens is not None and kept.probs.shape == (8, 3, 2), "a support is kept at its width"
    expected = _write_supports(kept)
    assert torch.equal(_dense(kept, 2), expected)
    assert torch.equal(kept.drawn[[0, 1, 1], [2, 0, 1]], torch.tensor([0.75, 0.5, 0.875]))
    # Distributions picked by flat row (-1: none): scattered into zero rows, -1 kept.
    rows, index = kept.dense(torch.tensor([5, -1, 3]), VOCAB)
    assert index.tolist() == [0, -1, 2]
    assert torch.equal(rows[0], expected[1, 2]) and torch.equal(rows[2], expected[1, 0])


def test_growth_keeps_what_the_store_held():
    """More rows (they double), a wider support (narrower writes pad with probability 0), then whole rows (a
    round without a top-k support): each a new object holding every distribution written before; a reserve
    that fits keeps the object a captured graph writes."""
    store = DraftProbsStore(k=3, device=torch.device("cpu"))
    kept = store.reserve(2, VOCAB, support=2)
    expected = _write_supports(kept)
    assert store.reserve(2, VOCAB, support=1) is kept, "a narrower round fits the wider store"
    wider = store.reserve(21, VOCAB, support=4)
    assert wider is not kept and wider.probs.shape == (21, 3, 4)
    assert torch.equal(_dense(wider, 2), expected) and not _dense(wider, 21)[2:].any()
    wider.write(torch.tensor([1]), torch.tensor([2]), torch.tensor([[1.0]]), torch.tensor([[2]]), torch.ones(1))
    expected[1, 2, 2] = 1.0
    whole = store.reserve(4, VOCAB, support=None)
    assert whole.tokens is None and whole.probs.shape == (21, 3, VOCAB)
    assert torch.equal(whole.probs[:2], expected) and torch.equal(whole.drawn[:2], wider.drawn[:2])
    assert store.reserve(4, VOCAB, support=2) is whole, "whole rows hold any support"
    whole.write(torch.tensor([0]), torch.tensor([2]), torch.tensor([[0.5, 0.5]]), torch.tensor([[6, 1]]), torch.ones(1))
    expected[0, 2] = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.5])
    assert torch.equal(whole.probs[:2], expected), "a support written into whole rows replaces the row"
