"""Fused layers (torchspec/fused_layers.py): recognised modules, shared weights, the same tokens, and a model
whose modules only look like the Llama ones runs unfused."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.torchspec.conftest import Batch, assert_same_tokens, tiny_spec
from torchspec import sparsespec
from torchspec.fused_layers import FusedLayers

BATCH = Batch((5, 11, 8), seed=3)
NEW_TOKENS = 14


def _fused_counts(wrapped) -> dict[str, int]:
    fused = wrapped.engine.fused_layers
    return {kind: fused.count(kind) for kind in ("decoder", "norm", "mlp", "attention")}


@pytest.mark.parametrize(("arch", "norms"), [("llama", 5), ("qwen2", 5), ("qwen3", 9)])
def test_fused_forwards_give_the_unfused_tokens(arch, norms, hf_reference):
    """Every layer of Llama, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) runs fused (whole decoder
    layers, and each of their modules for whoever calls it alone), and greedy speculative decoding gives
    transformers' tokens; the projections share the fused weights' storage, fused once."""
    spec = tiny_spec(arch)
    model = spec.build()
    wrapped = sparsespec.wrap(model, draft="pillar_recent", k=3, min_budget=4, kv_capacity_tokens=512)
    assert _fused_counts(wrapped) == {"decoder": 2, "norm": norms, "mlp": 2, "attention": 2}
    attention = model.model.layers[0].self_attn
    storages = {p.weight.untyped_storage().data_ptr() for p in (attention.q_proj, attention.k_proj, attention.v_proj)}
    assert len(storages) == 1
    # q, k and v hold 4 + 2 + 2 heads: one storage of twice the q weight, not a copy per fusion
    assert attention.q_proj.weight.untyped_storage().nbytes() == 2 * attention.q_proj.weight.nbytes
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


@pytest.mark.parametrize("fuse_layers", [None, False])
@pytest.mark.parametrize("autocast_at", ["around generate", "inside forward"])
def test_a_clients_autocast_leaves_the_engine_in_the_models_dtype(autocast_at, fuse_layers):
    """A client's bf16 autocast on a CPU, around ``generate`` or inside the model's forward (where accelerate's
    mixed precision puts it, and leaves it after training): the engine, built under it, computes in the model's
    dtype (fp32), fused or not, and gives the tokens it gives without one."""
    spec = tiny_spec("llama")
    options = {"draft": "pillar_recent", "k": 3, "min_budget": 4, "kv_capacity_tokens": 512, "fuse_layers": fuse_layers}
    expected = sparsespec.wrap(spec.build(), **options).generate(**BATCH.kwargs(), max_new_tokens=NEW_TOKENS)
    model = spec.build()
    wrapped = sparsespec.wrap(model, **options)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    if autocast_at == "inside forward":
        model.forward = autocast(model.forward)
        autocast = contextlib.nullcontext()
    with autocast:
        actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=NEW_TOKENS)
    assert torch.equal(actual, expected)
    if fuse_layers is None:
        assert _fused_counts(wrapped)["decoder"] == 2, "the probe should compare the layers in the model's dtype"


class _OffsetRMSNorm(LlamaRMSNorm):
    """Looks like Llama's RMSNorm but scales by ``1 + weight`` (Gemma's form)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) + hidden_states * 0 + 0.5 * self.weight


def test_a_wrapped_model_still_trains_and_the_next_rollout_reads_its_weights():
    """RL rollouts: an optimizer made before ``wrap()`` still holds the model's parameters (same objects), a
    backward pass reaches the fused q/k/v and gate/up weights (they were inference tensors, made under the
    engine's inference mode, and stopped training), and the next generation reads the stepped weights: it is
    the plain model's generate after the step."""
    spec = tiny_spec("llama")
    model = spec.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    names = {name: id(parameter) for name, parameter in model.named_parameters()}
    wrapped = sparsespec.wrap(model, k=3, min_budget=4, kv_capacity_tokens=512)
    assert {name: id(parameter) for name, parameter in model.named_parameters()} == names
    before = wrapped.generate(**BATCH.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False)
    fused = {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if name.endswith(("q_proj.weight", "up_proj.weight"))
    }
    ids, mask = BATCH.tensors()
    model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    optimizer.step()
    assert all(not torch.equal(fused[name], p) for name, p in model.named_parameters() if name in fused)
    after = wrapped.generate(**BATCH.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        plain = model.generate(**BATCH.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert_same_tokens(plain, after, spec, BATCH)
    assert not torch.equal(before, after), "the step should change the greedy tokens"


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


def test_a_fused_forward_that_fails_leaves_the_model_unfused(monkeypatch):
    """A transformers version that calls its layers another way makes a fused forward fail on the probe: the
    model then runs its own forward, with a warning naming the failure."""

    def incompatible(self, layer):
        def fused_decoder(hidden_states, *args, **kwargs):
            raise TypeError("fused_decoder() missing 1 required keyword-only argument: 'position_embeddings'")

        return fused_decoder

    monkeypatch.setattr(FusedLayers, "_decoder_forward", incompatible)
    spec = tiny_spec("llama")
    wrapped = sparsespec.wrap(spec.build(), draft=None, kv_capacity_tokens=256)
    with pytest.warns(UserWarning, match="failed on a probe forward.*position_embeddings"):
        assert wrapped.engine.fused_layers.forwards == {}
    expected = spec.build().generate(**BATCH.kwargs(), max_new_tokens=6, do_sample=False)
    assert torch.equal(wrapped.generate(**BATCH.kwargs(), max_new_tokens=6, do_sample=False), expected)


def test_fuse_layers_false_runs_the_models_own_forward():
    wrapped = sparsespec.wrap(tiny_spec("llama").build(), draft=None, fuse_layers=False, kv_capacity_tokens=128)
    assert wrapped.engine.fused_layers is None


def test_a_fused_layer_dispatches_eight_ops():
    """The layer-ops benchmark on the Triton op set (the interpreter on a CPU): a fused SmolLM2 layer's share of
    a decode step is two RMSNorms, two GEMMs, two GEMMs adding into the residual stream in place (an out-of-place
    ``addmm`` would copy the residual first on CUDA: one more kernel each), one SiLU x mul and the attention op
    (rotary embedding, K/V store and attention inside); unfused it is transformers' ~38."""
    from benchmarks.layer_ops import layer_ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fused = layer_ops(fuse_layers=True, device=device)
    assert fused == {"rms_norm": 2, "linear": 2, "addmm_": 2, "silu_and_mul": 1, "attend": 1}
    assert sum(layer_ops(fuse_layers=False, device=device).values()) >= 30
