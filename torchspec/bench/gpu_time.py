"""GPU time of a profiled window: how long the GPU was busy (the union of its kernels' intervals, so kernels
that overlap count once) and how much of it attention took. Shared by ``torchspec bench --model-config`` and the
developer profiles in ``benchmarks/``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

#: Kernels that make up attention: the paged kernel and the merge of its KV splits.
ATTENTION_KERNELS = ("_attention_kernel", "_merge_splits_kernel")

KERNEL_KINDS = {  # substrings of kernel names -> what the kernel does (first match wins)
    "_attention_kernel": "attention",
    "_merge_splits": "attention split merge",
    "_rotary_store_kernel": "RoPE + K/V store",
    "_rms_norm_kernel": "RMSNorm",
    "_silu_and_mul_kernel": "SiLU x mul",
    "store_kv": "K/V store",
    "index_copy": "K/V store",
    "gemm": "matmul",
    "nvjet": "matmul",
    "cutlass": "matmul",
    "triton_": "fused elementwise (compiled)",
}


def kernel_kind(name: str) -> str:
    """What a kernel does, from its name (``KERNEL_KINDS``; the rest: other elementwise ops and reductions)."""
    return next((kind for key, kind in KERNEL_KINDS.items() if key in name), "other elementwise / reduction")


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float


def kernels(prof: torch.profiler.profile) -> list[Kernel]:
    """The GPU kernels (and copies) a ``torch.profiler`` window recorded, graph replays' included."""
    return [
        Kernel(event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]


def busy_us(window: Iterable[Kernel]) -> float:
    """Time in which at least one kernel ran."""
    busy, start, end = 0.0, None, None
    for kernel in sorted(window, key=lambda k: k.start_us):
        if end is None or kernel.start_us > end:
            busy += 0.0 if end is None else end - start
            start, end = kernel.start_us, kernel.end_us
        else:
            end = max(end, kernel.end_us)
    return busy + (0.0 if end is None else end - start)


def attention_us(window: Sequence[Kernel]) -> float:
    """Summed time of the attention kernels (they do not overlap one another: one stream)."""
    return sum(k.end_us - k.start_us for k in window if any(name in k.name for name in ATTENTION_KERNELS))
