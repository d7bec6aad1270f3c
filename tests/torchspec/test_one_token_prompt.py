"""A one-token prompt is prefilled like any other: its token has no K/V yet and is not on the device, so its
first step must not be a decoding step fed "the newest token" (it read whatever the device held)."""

from __future__ import annotations

import pytest

from tests.torchspec.conftest import Batch, assert_same_tokens, tiny_spec
from torchspec import sparsespec


@pytest.mark.parametrize("draft", [None, "pillar_recent"])
def test_one_token_prompts_match_transformers(hf_reference, draft: str | None) -> None:
    spec, batch = tiny_spec("qwen3"), Batch((1, 6, 1), seed=3)
    model = sparsespec.wrap(spec.build(), draft=draft, max_batch_size=4, kv_capacity_tokens=256)
    out = model.generate(**batch.kwargs(), max_new_tokens=12, do_sample=False)
    assert_same_tokens(hf_reference(spec, batch, max_new_tokens=12), out, spec, batch)
