"""The draft-probs store: what the draft steps wrote is what the verify reads, padding reads as zeros."""

from __future__ import annotations

import torch

from torchspec.draft_probs import DraftProbsStore


def test_store_reads_what_was_written_zero_past_each_round_and_survives_growth():
    """Rows written in different steps come back together; rows never written (a verify without drafts) read as
    zeros instead of indexing past the buffer."""
    store = DraftProbsStore(k=3, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    first = torch.rand(2, 5, generator=generator)
    store.write([0, 1], [0, 0], first)  # step 1: drafts 0 of rows 0 and 1
    second = torch.rand(1, 5, generator=generator)
    store.write([0], [1], second)  # step 2: draft 1 of row 0 only
    late = torch.rand(1, 5, generator=generator)
    store.write([20], [0], late)  # a row past the buffer: it grows, keeping what it held
    read = store.read([0, 1, 20, 50], torch.tensor([2, 1, 1, 0]), width=2, vocab_size=5)  # row 50: never written
    assert read.shape == (4, 2, 5)
    assert not read[3].any()
    assert torch.equal(read[0], torch.stack([first[0], second[0]]))
    assert torch.equal(read[1, 0], first[1]) and torch.equal(read[2, 0], late[0])
    assert not read[1, 1].any() and not read[2, 1].any(), "entries past a round's drafts must read as zeros"
