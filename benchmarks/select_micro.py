"""GPU micro-benchmark of a round's three Top-Ks at W1's shapes, ``torch.topk`` pipelines against the radix
selection kernel (``attention.select_kernels``): the verify's top-50 cut-off of 2,304 x 49,152 bf16 logits, a
draft's top-50 support of 256 rows, PillarAttn's picks over 30 layers x 3 KV heads x 256 requests x 4.2K fp16
masses (then sorted). Random data; CUDA only; one JSON record per line.

    python benchmarks/select_micro.py > benchmarks/results/select_micro_h200.jsonl
"""

import json
from collections.abc import Callable

import torch

from attention import select_kernels

DEVICE = "cuda"


def milliseconds(fn: Callable[[], object], reps: int = 20) -> float:
    """Mean time of ``fn()`` on the GPU after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def cutoff_topk(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return logits.topk(50, dim=-1).values.gather(1, (k - 1)[:, None])[:, 0]


def cutoff_kernel(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    positions = select_kernels.top_k_positions(logits, k, 50)
    return logits.gather(1, positions).amin(dim=-1)


def support_topk(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.topk(50, dim=-1)


def support_kernel(logits: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = select_kernels.top_k_positions(logits, k, 50)
    values, order = logits.gather(1, positions).sort(dim=-1, descending=True)
    return values, positions.gather(1, order)


def pillar_topk(mass: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    picks = mass.topk(int(counts.max()), dim=-1).indices.int()
    ranks = torch.arange(picks.shape[-1], device=DEVICE)
    return torch.where(ranks < counts[:, None], picks, -1).sort(dim=-1).values


def vocab_record(rows: int, generator: torch.Generator) -> dict:
    logits = (torch.randn(rows, 49152, device=DEVICE, generator=generator) * 3).bfloat16()
    k = torch.full((rows,), 50, device=DEVICE)
    assert torch.equal(cutoff_kernel(logits, k), cutoff_topk(logits, k))
    return {
        "what": f"vocab top-50 of {rows} x 49152 bf16",
        "cutoff topk": milliseconds(lambda: cutoff_topk(logits, k)),
        "cutoff kernel": milliseconds(lambda: cutoff_kernel(logits, k)),
        "support topk": milliseconds(lambda: support_topk(logits)),
        "support kernel": milliseconds(lambda: support_kernel(logits, k)),
    }


def pillar_record(context: int, generator: torch.Generator) -> dict:
    mass = (torch.rand(30, 3, 256, context, device=DEVICE, generator=generator) ** 8).half()
    counts = torch.randint(context // 40, context // 20, (256,), device=DEVICE)
    max_count = int(counts.max())
    picks = select_kernels.top_k_positions(mass, counts, max_count)
    assert torch.equal((picks >= 0).sum(dim=-1), counts.expand(30, 3, -1))
    return {
        "what": f"pillar picks of 30 x 3 x 256 x {context} fp16, {context // 40}-{context // 20} each, sorted",
        "topk+sort": milliseconds(lambda: pillar_topk(mass, counts)),
        "kernel": milliseconds(lambda: select_kernels.top_k_positions(mass, counts, max_count)),
    }


def main() -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for rows in (2304, 256):
        print(json.dumps(vocab_record(rows, generator)), flush=True)
    for context in (2000, 4200, 8000):
        print(json.dumps(pillar_record(context, generator)), flush=True)


if __name__ == "__main__":
    main()
