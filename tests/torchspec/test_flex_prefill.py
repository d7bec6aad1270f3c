"""``attention_backend="flex"``: prefill chunks through FlexAttention give the reference path's tokens."""

from __future__ import annotations

import pytest
import torch

from attention import flex
from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import sparsespec

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("draft", [None, "pillar_recent"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flex_prefill_gives_the_reference_tokens(arch, draft, monkeypatch):
    """Greedy generation with prompts prefilled in chunks of up to 96 tokens through FlexAttention (the last
    chunk also feeding PillarAttn's verify scores) equals the reference backend token for token, and
    FlexAttention really ran."""
    calls = []
    prefill = flex.prefill_attention
    monkeypatch.setattr(flex, "prefill_attention", lambda *a, **k: calls.append(1) or prefill(*a, **k))
    spec, batch = tiny_spec(arch, 2), Batch((150, 90, 70), seed=6)
    options = {"kv_capacity_tokens": 1024, "k": 4, "min_budget": 8, "max_step_tokens": 96, "draft": draft}
    expected = sparsespec.wrap(spec.build(), attention_backend="reference", **options).generate(
        **batch.kwargs(), max_new_tokens=16, do_sample=False
    )
    actual = sparsespec.wrap(spec.build(), attention_backend="flex", **options).generate(
        **batch.kwargs(), max_new_tokens=16, do_sample=False
    )
    assert torch.equal(expected, actual)
    assert calls, "no step went through FlexAttention"
