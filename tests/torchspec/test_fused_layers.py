"""Fused layers (torchspec/fused_layers.py): recognised modules, shared weights, the same tokens, and a model
whose modules only look like the Llama ones runs unfused."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.torchspec.conftest import Batch, assert_same_tokens, tiny_spec
from torchspec import sparsespec

BATCH = Batch((5, 11, 8), seed=3)
NEW_TOKENS = 14


def _fused_counts(wrapped) -> dict[str, int]:
    fused = wrapped.engine.fused_layers
    return {kind: fused.count(kind) for kind in ("norm", "mlp", "attention")}


@pytest.mark.parametrize(("arch", "norms"), [("llama", 5), ("qwen2", 5), ("qwen3", 9)])
def test_fused_forwards_give_the_unfused_tokens(arch, norms, hf_reference):
    """Every layer of Llama, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) runs fused, and greedy
    speculative decoding gives transformers' tokens; the projections share the fused weights' storage."""
    spec = tiny_spec(arch)
    model = spec.build()
    wrapped = sparsespec.wrap(model, draft="pillar_recent", k=3, min_budget=4, kv_capacity_tokens=512)
    assert _fused_counts(wrapped) == {"norm": norms, "mlp": 2, "attention": 2}
    attention = model.model.layers[0].self_attn
    storages = {p.weight.untyped_storage().data_ptr() for p in (attention.q_proj, attention.k_proj, attention.v_proj)}
    assert len(storages) == 1
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert_same_tokens(hf_reference(spec, BATCH, max_new_tokens=NEW_TOKENS), actual, spec, BATCH)


def test_the_model_outside_an_engine_run_is_unchanged():
    """Wrapping leaves the model's own forward (its modules, its logits) as it was."""
    spec = tiny_spec("qwen3")
    model, ids = spec.build(), torch.tensor([[3, 9, 27, 81]])
    with torch.inference_mode():
        before = model(ids).logits
        sparsespec.wrap(model, draft=None, kv_capacity_tokens=128)
        after = model(ids).logits
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert torch.equal(before, after)


class _OffsetRMSNorm(LlamaRMSNorm):
    """Looks like Llama's RMSNorm but scales by ``1 + weight`` (Gemma's form)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) + hidden_states * 0 + 0.5 * self.weight


def test_a_module_that_only_looks_fusable_leaves_the_model_unfused(hf_reference):
    spec = tiny_spec("llama")
    model = spec.build()
    for layer in model.model.layers:
        norm = _OffsetRMSNorm(layer.input_layernorm.weight.numel(), layer.input_layernorm.variance_epsilon)
        norm.weight.data.copy_(layer.input_layernorm.weight)
        layer.input_layernorm = norm
    wrapped = sparsespec.wrap(model, draft=None, kv_capacity_tokens=256)
    with pytest.warns(UserWarning, match="runs unfused"):
        assert wrapped.engine.fused_layers.forwards == {}  # the engine (and its probe) is built at first use
    expected = model.generate(**BATCH.kwargs(), max_new_tokens=6, do_sample=False)
    assert torch.equal(wrapped.generate(**BATCH.kwargs(), max_new_tokens=6, do_sample=False), expected)


def test_fuse_layers_false_runs_the_models_own_forward():
    wrapped = sparsespec.wrap(tiny_spec("llama").build(), draft=None, fuse_layers=False, kv_capacity_tokens=128)
    assert wrapped.engine.fused_layers is None
