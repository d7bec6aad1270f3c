"""The draft-probs store: what the draft steps wrote stays where the verify looks for it."""

from __future__ import annotations

import torch

from torchspec.draft_probs import DraftProbsStore


def test_store_keeps_what_was_written_where_the_verify_looks_and_survives_growth():
    """Rows written in different steps sit at (slot-table row, draft index); a write past the buffer grows it,
    keeping what it held, and rows never written hold zeros."""
    store = DraftProbsStore(k=3, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    first = torch.rand(2, 5, generator=generator)
    store.write([0, 1], [0, 0], first)  # step 1: drafts 0 of rows 0 and 1
    second = torch.rand(1, 5, generator=generator)
    store.write([0], [1], second)  # step 2: draft 1 of row 0 only
    late = torch.rand(1, 5, generator=generator)
    store.write([20], [0], late)  # a row past the buffer: it grows, keeping what it held
    assert store.probs.shape[0] > 20 and store.probs.shape[1:] == (3, 5)
    assert torch.equal(store.probs[0, :2], torch.stack([first[0], second[0]]))
    assert torch.equal(store.probs[1, 0], first[1]) and torch.equal(store.probs[20, 0], late[0])
    assert not store.probs[2:20].any() and not store.probs[1, 1:].any()
