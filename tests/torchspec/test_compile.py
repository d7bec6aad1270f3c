"""``compile=True``: the model forward under torch.compile gives the eager forward's tokens.

Attention is one opaque custom op per layer (``torchspec::attend``), so the compiled graph never sees the
step's metadata and the packed token count is a dynamic dimension: one compilation serves prefill, draft
and verify steps alike. On the CPU this runs Inductor's C++ backend (slow to compile: one small test).
"""

from __future__ import annotations

import pytest
import torch

from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import sparsespec

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]


def test_compiled_forward_matches_eager_with_speculation():
    """Greedy speculation (prefill, sparse drafts, verifies) with the compiled forward equals plain eager
    decoding token for token, and the compiled module was really used."""
    spec, batch = tiny_spec("llama", 2), Batch((9, 30, 17), seed=5)
    options = {"kv_capacity_tokens": 256, "k": 4, "min_budget": 6}
    expected = sparsespec.wrap(spec.build(), draft=None, **options).generate(
        **batch.kwargs(), max_new_tokens=12, do_sample=False
    )
    wrapped = sparsespec.wrap(spec.build(), draft="pillar_recent", compile=True, **options)
    assert wrapped.engine.runner.forward is not wrapped.engine.runner.model
    actual = wrapped.generate(**batch.kwargs(), max_new_tokens=12, do_sample=False)
    assert torch.equal(expected, actual)
    assert wrapped.last_stats.num_rounds > 0
