"""GPU micro-benchmark behind the dtype choices of the token-selection and PillarAttn paths (raw H200 output,
with the launch configurations of the separate mass pass the attention has since absorbed:
``results/micro_topk_mass_h200.txt``): ``topk`` and ``sort`` by dtype at W1's shapes (PillarAttn's Top-K over
30 layers x 3 KV heads x 256 requests x 6.4K candidates, the successor sort, the vocabulary top-50 of 256 and
2,304 rows). Random data; CUDA only.

    python benchmarks/topk_micro.py
"""

from collections.abc import Callable

import torch

DEVICE = "cuda"


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


if __name__ == "__main__":
    selection_ops()
