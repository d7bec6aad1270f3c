"""Compile the Triton kernels' real launches for the H100/H200 (sm_90) without a GPU.

Triton's CPU interpreter runs a kernel as Python, so it misses what only the compiler checks: a variable whose
type differs between branches (an int32 bound assigned over an int64 one failed on the GPU only), constexpr
misuse, layouts the code generator rejects. Here the host code's launches are recorded instead of run, and
each is compiled to a cubin from its real arguments, specialised the way Triton's JIT would. Runs in its own
process (``python -m tests.attention.gpu_compile NAME...``, prints ``{name: "ok" | error}`` as JSON): under
``TRITON_INTERPRET=1`` every ``@triton.jit`` function, Triton's own included, is an interpreter object.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from attention import layer_kernels, logits_kernels, paged, select_kernels, sketch_kernels
from attention.reference import MASS_DTYPE, FirstLists

H200 = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
}
KERNELS = (
    (paged, "_attention_kernel"),
    (paged, "_merge_splits_kernel"),
    (layer_kernels, "_rms_norm_kernel"),
    (layer_kernels, "_silu_and_mul_kernel"),
    (layer_kernels, "_rotary_store_kernel"),
    (logits_kernels, "_warped_lse_kernel"),
    (logits_kernels, "_warped_sample_kernel"),
    (select_kernels, "_top_k_kernel"),
    (sketch_kernels, "_store_sketch_kernel"),
    (sketch_kernels, "_sketch_mass_kernel"),
    (sketch_kernels, "_sketch_lists_kernel"),
)


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` stores the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _compile(kernel: JITFunction, args: tuple, kwargs: dict) -> None:
    """Compile one launch for sm_90: tensors become typed pointers, Python ints i32/i64 scalars, and pointers
    and ints divisible by 16 carry that hint (what makes Triton vectorise the loads)."""
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        divisible = False
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TRITON_TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        else:
            signature[param.name] = "fp32"
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=H200, options=options)
    assert compiled.asm["cubin"]


def _split_launch(num_heads: int, num_kv_heads: int, head_dim: int, q_len: int, dtype: torch.dtype,
                  window: int | None = None) -> Callable[[], None]:  # fmt: skip
    """Long lists over a small batch: a split attention launch and its merge."""

    def launch() -> None:
        batch, context = 2, 2048
        k = torch.randn(batch * context, num_kv_heads, head_dim).to(dtype)
        query = torch.randn(batch * q_len, num_heads, head_dim).to(dtype)
        indptr, indices = torch.arange(batch + 1) * context, torch.arange(batch * context)
        cu = torch.arange(batch + 1) * q_len
        paged.paged_attention(query, k, k, cu, indptr, indices, 0.125, window, max_q_len=q_len, max_kv_len=context)

    return launch


def _fused_launch_and_mass() -> None:
    """Per-KV-head draft lists (with padding) and a verify in one launch, the verify writing its mass."""
    num_heads, num_kv_heads, head_dim, drafts, context, budget = 9, 3, 64, 8, 2048, 128
    k = torch.randn(context, num_kv_heads, head_dim).to(torch.bfloat16)
    indptr, indices = torch.tensor([0, context]), torch.arange(context)
    draft_indptr = torch.arange(drafts + 1) * budget
    draft_indices = torch.randint(-1, context, (num_kv_heads, drafts * budget))
    query = torch.randn(drafts + 9, num_heads, head_dim).to(torch.bfloat16)
    cu = torch.cat([torch.arange(drafts + 1), torch.tensor([drafts + 9])])
    first = FirstLists(drafts, draft_indptr, draft_indices, 1, budget)
    mass = torch.zeros(num_kv_heads, 1, context, dtype=MASS_DTYPE)
    paged.paged_attention(query, k, k, cu, indptr, indices, 0.125, max_q_len=9, max_kv_len=context, first_lists=first,
                          mass=mass, num_scored_queries=torch.tensor([9]), max_scored_queries=9)  # fmt: skip


def _layer_ops() -> None:
    """A SmolLM2 layer's small ops in bf16: RMSNorm of rows and of heads read in place, SiLU x mul, RoPE with
    the K/V store."""
    qkv = torch.randn(16, 15, 64).to(torch.bfloat16)
    weight = torch.randn(64).to(torch.bfloat16)
    layer_kernels.rms_norm(torch.randn(16, 576).to(torch.bfloat16), torch.randn(576).to(torch.bfloat16), 1e-5)
    layer_kernels.rms_norm(qkv[:, :9], weight, 1e-6)
    layer_kernels.silu_and_mul(torch.randn(16, 3072).to(torch.bfloat16))
    cos = torch.randn(16, 64).to(torch.bfloat16)
    cache = torch.zeros(64, 3, 64).to(torch.bfloat16)
    layer_kernels.rotary_store_kv(qkv[:, :9], qkv[:, 9:12], qkv[:, 12:], cos, cos, cache, cache, torch.arange(16))


def _warped_lse() -> None:
    """The log-normaliser of a verify's warped rows over SmolLM2's vocabulary, from its bf16 logits."""
    logits = torch.randn(18, 49152).to(torch.bfloat16)
    logits_kernels.warped_lse(logits, torch.full((18,), 0.65), torch.zeros(18))


def _warped_sample() -> None:
    """A plain step's draws over SmolLM2's vocabulary, from its bf16 logits, and a verify's corrections (less the
    rejected drafts' rows of the fp32 draft-probs store)."""
    logits = torch.randn(18, 49152).to(torch.bfloat16)
    rows, temperature, cutoff = torch.arange(18), torch.full((18,), 0.65), torch.zeros(18)
    seed = torch.ones(1, dtype=torch.int64)
    logits_kernels.warped_sample(logits, rows, temperature, cutoff, seed)
    store = torch.zeros(4 * 8, 49152)
    logits_kernels.warped_sample(logits, rows, temperature, cutoff, seed, torch.zeros(18), store, rows - 1)


def _top_k() -> None:
    """A verify's top-50 cut-off over SmolLM2's vocabulary (long rows, bf16) and PillarAttn's picks over fp16
    masses (rows in registers) and fp32 ones."""
    select_kernels.top_k_positions(torch.randn(18, 49152).to(torch.bfloat16), torch.full((18,), 50), 50)
    select_kernels.top_k_positions(torch.rand(2, 3, 4, 900).half(), torch.tensor([30, 0, 45, 12]), 45)
    select_kernels.top_k_positions(torch.rand(4, 3000), torch.tensor([30, 0, 45, 12]), 45)


def _key_sketch() -> None:
    """SmolLM2's int4 key sketch (3 KV heads of 64, GQA groups of 3) at a query sketch's W1 shapes: written with
    a step's keys; 256 drafts scoring their older positions (a round's first) or sinks and a shortlist, one k and
    length a request over its KV heads; the picks (and a shortlist of thousands: the whole-row search) and the
    lists built from them."""
    k_cache = torch.randn(1000, 3, 64).to(torch.bfloat16)
    codes, scales = torch.zeros(1000, 3, 32, dtype=torch.uint8), torch.zeros(1000, 3)
    sketch_kernels.store_key_sketch(k_cache, torch.arange(300), codes, scales)
    drafts, table, listed = 256, torch.zeros(257, 8352, dtype=torch.int64), torch.zeros(257, 3, 3344, dtype=torch.int32)
    query, per_request = torch.randn(drafts, 3, 3, 64).to(torch.bfloat16), torch.zeros(drafts, dtype=torch.int64)
    rows = torch.arange(drafts)
    for width in (8352, 3348):
        mass = sketch_kernels.sketch_mass(
            query, codes, scales, table, rows, per_request, listed, per_request, 0.125, per_request, width
        )
        counts = torch.full((drafts, 1), 200)
        picks = select_kernels.top_k_positions(mass, counts, 418, counts)
        select_kernels.top_k_positions(mass, counts * 8, 3344, counts)
        sketch_kernels.sketch_lists(
            picks, table, rows, per_request, listed, per_request, per_request, per_request, per_request, 1, 594
        )


SCENARIOS: dict[str, Callable[[], None]] = {
    "smollm2-decode": _split_launch(9, 3, 64, 1, torch.bfloat16),
    "smollm2-verify": _split_launch(9, 3, 64, 9, torch.bfloat16),
    "qwen3-decode": _split_launch(32, 8, 128, 1, torch.bfloat16),
    "qwen3-verify": _split_launch(32, 8, 128, 9, torch.bfloat16),
    "prefill-chunk": _split_launch(9, 3, 64, 64, torch.bfloat16),
    "sliding-window": _split_launch(8, 2, 64, 5, torch.bfloat16, window=100),
    "fp32": _split_launch(8, 2, 64, 5, torch.float32),  # exact dots: the test and parity path
    "fused-and-mass": _fused_launch_and_mass,
    "layer-ops": _layer_ops,
    "warped-lse": _warped_lse,
    "warped-sample": _warped_sample,
    "top-k": _top_k,
    "key-sketch": _key_sketch,
}


def check(name: str) -> str:
    """ "ok" when every launch of scenario ``name`` compiles, else the error."""
    kernels = {kernel: getattr(module, kernel) for module, kernel in KERNELS}
    recorders = {kernel: _Recorder() for _, kernel in KERNELS}
    try:
        for module, kernel in KERNELS:
            setattr(module, kernel, recorders[kernel])
        SCENARIOS[name]()
        launches = [(kernels[k], call) for k, r in recorders.items() for call in r.calls]
        if not launches:
            return "no launch recorded"
        for kernel, (args, kwargs) in launches:
            _compile(kernel, args, kwargs)
        return "ok"
    except Exception:
        return traceback.format_exc(limit=-3)[-3000:]
    finally:
        for module, kernel in KERNELS:
            setattr(module, kernel, kernels[kernel])


if __name__ == "__main__":
    print(json.dumps({name: check(name) for name in sys.argv[1:] or SCENARIOS}))
