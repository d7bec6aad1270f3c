"""The layer kernels (RMSNorm, SiLU x mul, rotary embedding with the K/V store) against their reference, and
the transformers modules it specifies. Without CUDA the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from attention import layer_kernels, reference

pytestmark = pytest.mark.usefixtures("single_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (the kernels sum in another order)."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[expected.dtype]
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=tol, rtol=tol)


def test_reference_is_what_transformers_computes():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(48, eps=1e-5)
    norm.weight.data.normal_()
    x = torch.randn(5, 48, dtype=torch.float16)
    assert torch.equal(reference.rms_norm(x, norm.weight.half(), 1e-5), norm.half()(x))
    q, k = torch.randn(4, 6, 16), torch.randn(4, 2, 16)
    cos, sin = torch.randn(4, 16), torch.randn(4, 16)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    q_ref, k_ref = reference.rotary_embedding(q, k, cos, sin)
    assert torch.equal(q_ref, q_hf[0].transpose(0, 1)) and torch.equal(k_ref, k_hf[0].transpose(0, 1))
    gate_up = torch.randn(3, 20)
    assert torch.equal(reference.silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :10]) * gate_up[:, 10:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (3, 1000)])
def test_rms_norm(dtype, shape):
    torch.manual_seed(1)
    x, weight = torch.randn(shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype)
    _close(layer_kernels.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_read_in_place(dtype):
    """Per-head norms (Qwen3's q_norm) read a head slice of a fused QKV output without copying it."""
    torch.manual_seed(2)
    qkv = torch.randn(5, 10, 32, dtype=dtype)
    heads, weight = qkv[:, 2:8], torch.randn(32, dtype=dtype)
    _close(layer_kernels.rms_norm(heads.to(DEVICE), weight.to(DEVICE), 1e-6), reference.rms_norm(heads, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 1536])
def test_silu_and_mul(dtype, width):
    torch.manual_seed(3)
    gate_up = torch.randn(6, 2 * width, dtype=dtype)
    _close(layer_kernels.silu_and_mul(gate_up.to(DEVICE)), reference.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (9, 3)])
def test_rotary_store_kv_of_a_fused_qkv(dtype, head_dim, heads, kv_heads):
    """Rotated queries come back; rotated keys and the values land in the cache rows of their slots, and no
    other row changes (head counts below a power of two: SmolLM2's 9 and 3)."""
    torch.manual_seed(4)
    tokens = 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    cos, sin = torch.randn(tokens, head_dim, dtype=dtype), torch.randn(tokens, head_dim, dtype=dtype)
    slots = torch.tensor([7, 2, 9, 0, 4])
    caches = [torch.randn(12, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    expected = reference.rotary_store_kv(q, k, v, cos, sin, *expected_caches, slots)
    on_device = [c.to(DEVICE) for c in caches]
    actual = layer_kernels.rotary_store_kv(*(t.to(DEVICE) for t in (q, k, v, cos, sin)), *on_device, slots.to(DEVICE))
    _close(actual, expected)
    _close(on_device[0], expected_caches[0])
    assert torch.equal(on_device[1].cpu(), expected_caches[1])  # values are copied, not computed
    untouched = [slot for slot in range(12) if slot not in slots.tolist()]
    assert torch.equal(on_device[0].cpu()[untouched], caches[0][untouched])


def test_every_op_set_provides_every_op():
    """The engine swaps op sets whole: the reference, the Triton ops and the flex set each have every op."""
    from attention import flex, ops

    for op_set in (reference, ops, flex.with_flex_prefill(ops)):
        assert all(callable(getattr(op_set, name, None)) for name in reference.OP_NAMES), op_set
