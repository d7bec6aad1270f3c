"""GPU micro-benchmarks behind two choices of the token-selection and PillarAttn paths (raw H200 output:
``results/micro_topk_mass_h200.txt``): ``topk`` and ``sort`` by dtype at W1's shapes (PillarAttn's Top-K over
30 layers x 3 KV heads x 256 requests x 6.4K candidates, the successor sort, the vocabulary top-50 of 256 and
2,304 rows), and the mass kernel's launch configurations at one layer of W1 at 6.5K context. Random data; CUDA
only.

    python benchmarks/topk_mass_micro.py > benchmarks/results/micro_topk_mass_h200.txt
"""

from collections.abc import Callable

import torch

from attention import paged
from attention.reference import MASS_DTYPE

DEVICE = "cuda"
# One layer of W1 at 6.5K context: 256 verifies x 9 queries, 9 query heads over 3 KV heads of 64 dims, bf16.
B, Q, H, HKV, D, L = 256, 9, 9, 3, 64, 6500


def milliseconds(fn: Callable[..., object], *args: object, reps: int = 20, **kwargs: object) -> float:
    """Mean time of ``fn(*args, **kwargs)`` on the GPU after one warm-up call."""
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(*args, **kwargs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def selection_ops() -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    mass = torch.rand(30, 3, 256, 6400, device=DEVICE, generator=generator) ** 8
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ms = milliseconds(torch.topk, mass.to(dtype), 52, dim=-1)
        print(f"pillar topk 52 of 23040x6400 {dtype}: {ms:.3f} ms", flush=True)
    positions = torch.randint(0, 6400, (23040, 260), device=DEVICE)
    for dtype in (torch.int64, torch.int32):
        print(f"sort 23040x260 {dtype}: {milliseconds(torch.sort, positions.to(dtype), dim=-1):.3f} ms", flush=True)
    for rows in (256, 2304):
        logits = (torch.randn(rows, 49152, device=DEVICE, generator=generator) * 3).to(torch.bfloat16)
        for dtype in (torch.float32, torch.bfloat16):
            ms = milliseconds(torch.topk, logits.to(dtype), 50, dim=-1)
            print(f"vocab topk 50 of {rows}x49152 {dtype}: {ms:.3f} ms", flush=True)


def mass_kernel_configurations() -> None:
    k_cache = torch.randn(B * L + 16, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    query = torch.randn(B * Q, H, D, device=DEVICE, dtype=torch.bfloat16)
    cu_seqlens_q = torch.arange(0, B * Q + 1, Q, device=DEVICE)
    indptr = torch.arange(0, B * L + 1, L, device=DEVICE)
    indices = torch.arange(B * L, device=DEVICE)  # contiguous slots, as a pool filled in order
    lse = torch.full((B * Q, H), 8.0, device=DEVICE)
    scored = torch.full((B,), Q, device=DEVICE)
    inputs = (query, k_cache, cu_seqlens_q, indptr, indices, lse, 0.125, scored)
    shipped = milliseconds(paged.attention_mass, *inputs, max_scored=Q, max_kv_len=L)
    print(f"attention_mass as shipped: {shipped:.3f} ms ({B * L * HKV * D * 2 / shipped / 1e9:.2f} TB/s of K)")
    out = torch.zeros(HKV, B, L, dtype=MASS_DTYPE, device=DEVICE)
    for splits in (1, 2, 4, 8):
        args = [query, k_cache, lse, out, cu_seqlens_q, indptr, indices, scored, splits, query.stride(0),
                query.stride(1), k_cache.stride(0), k_cache.stride(1), lse.stride(0), lse.stride(1), out.stride(0),
                out.stride(1), 0.125 * paged.LOG2E]  # fmt: skip
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    kernel = paged._mass_kernel[(B, HKV, splits)]
                    constants = dict(GROUP=H // HKV, HEAD_DIM=D, BLOCK_D=D, BLOCK_M=32, BLOCK_N=block_n,
                                     DOT_PRECISION="tf32", num_warps=warps, num_stages=stages)  # fmt: skip
                    ms = milliseconds(kernel, *args, reps=5, **constants)
                    print(f"mass splits={splits} block_n={block_n} warps={warps} stages={stages}: {ms:.3f} ms")


if __name__ == "__main__":
    selection_ops()
    mass_kernel_configurations()
