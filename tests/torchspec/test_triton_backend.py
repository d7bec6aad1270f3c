"""The engine on the Triton kernels gives the reference path's tokens.

Without CUDA the kernels run in Triton's CPU interpreter (slow: small batches, few tokens); with CUDA the
same tests run on the GPU. fp32 throughout, so equality is token for token.
"""

from __future__ import annotations

import pytest
import torch

from tests.torchspec.conftest import Batch, generate_checking_key_sketches, tiny_spec
from torchspec import sparsespec

pytestmark = pytest.mark.usefixtures("single_thread", "small_wave")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH = Batch((9, 30, 17), seed=5)
NEW_TOKENS = 12
SLIDING = tiny_spec(
    "qwen3", use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]
)


def _generate(spec, new_tokens: int = NEW_TOKENS, **options) -> torch.Tensor:
    model = spec.build().to(DEVICE)
    wrapped = sparsespec.wrap(model, kv_capacity_tokens=256, **options)
    kwargs = {name: tensor.to(DEVICE) for name, tensor in BATCH.kwargs().items()}
    return wrapped.generate(**kwargs, max_new_tokens=new_tokens, do_sample=False).cpu()


@pytest.mark.parametrize(
    ("spec", "draft"),
    [
        (tiny_spec("llama", 2), None),
        (tiny_spec("llama", 2), "pillar"),  # fused draft + verify launches and the verify-mass kernel
        (SLIDING, "quest"),  # lists chosen inside attention, a sliding-window layer
    ],
    ids=["llama-plain", "llama-pillar", "qwen3-window-quest"],
)
def test_triton_backend_matches_reference(spec, draft):
    """Greedy tokens on attention_backend="triton" equal attention_backend="reference" (with sparse drafts:
    min_budget=6 keeps them sparse, so the per-head lists, their padding and the fused launch are exercised)."""
    options = {"draft": draft, "k": 4, "min_budget": 6, "sparsity": 0.1}
    expected = _generate(spec, attention_backend="reference", **options)
    actual = _generate(spec, attention_backend="triton", **options)
    assert torch.equal(expected, actual), f"first differing row: {(expected != actual).any(dim=1).nonzero()}"


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_query_sketch_keeps_and_scores_its_key_sketch_on_the_kernels(cuda_graphs):
    """The store kernel writes every new key's sketch (prompt, drafts, verifies) and the drafts score it and build
    their lists on the kernels, in eager forwards and in the graphs' static ones: same tokens as the reference
    path, whose sketch is computed by the reference ops. Two rounds a request (8 tokens at k=4: the interpreter
    takes ~2.5 s a forward here)."""
    options = {"draft": "query_sketch", "k": 4, "min_budget": 6, "sparsity": 0.1, "recent_window": 1, "num_sinks": 0}
    expected = _generate(tiny_spec("llama", 2), new_tokens=8, attention_backend="reference", **options)
    model = tiny_spec("llama", 2).build().to(DEVICE)
    wrapped = sparsespec.wrap(model, attention_backend="triton", cuda_graphs=cuda_graphs, **options)
    actual = generate_checking_key_sketches(wrapped, BATCH, max_new_tokens=8, do_sample=False).cpu()
    assert torch.equal(expected, actual)
    assert wrapped.last_stats.num_rounds >= len(BATCH.lengths), "too few rounds drafted and verified"


def test_auto_backend_follows_the_device():
    """ "auto" takes the Triton kernels on CUDA and the reference elsewhere."""
    import attention
    from attention import reference

    assert attention.load_ops("auto", torch.device("cpu")) is reference
    if torch.cuda.is_available():
        assert attention.load_ops("auto", torch.device("cuda")) is not reference


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    """Triton cannot run CPU tensors outside its interpreter: the error says what to use instead."""
    import attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"needs a CUDA device.*TRITON_INTERPRET=1"):
        attention.load_ops("triton", torch.device("cpu"))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        sparsespec.wrap(tiny_spec("llama", 2).build(), attention_backend="flash")
