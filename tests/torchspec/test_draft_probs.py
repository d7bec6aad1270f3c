"""The draft-probs store: it grows without losing what the draft forwards wrote."""

from __future__ import annotations

import torch

from torchspec.draft_probs import DraftProbsStore


def test_growth_keeps_what_the_store_held():
    """A row past the buffer grows it (rows double), keeping what it held; rows never written hold zeros."""
    store = DraftProbsStore(k=3, device=torch.device("cpu"))
    store.reserve(2, 5)
    written = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(0))
    store.probs[:2] = written
    before = store.probs
    store.reserve(2, 5)
    assert store.probs is before, "a reserve that fits must keep the buffer (a captured graph writes it)"
    store.reserve(21, 5)
    assert store.probs.shape[0] >= 21 and store.probs.shape[1:] == (3, 5)
    assert torch.equal(store.probs[:2], written) and not store.probs[2:].any()
