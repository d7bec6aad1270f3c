"""GPU busy time per engine step in steady state, and the kernels that fill it (CUDA only).

    python benchmarks/gpu_busy_profile.py MODEL.gguf NEW_TOKENS DRAFT STEPS SPAN ['{"engine": "options"}']

Runs W1's prompts (256, T=0.65, EOS held back) with ``DRAFT`` (``none`` or a policy) after a 16-token warm-up;
for ``SPAN`` steps from each step number in ``STEPS`` (comma-separated) it records the GPU's kernels with
``torch.profiler`` (CUDA activity only) and prints the wall time per step, the GPU busy time per step (the union
of kernel intervals), their span, the kernels by total time, and the window's first forwards one by one (a
verify, the drafts of a round) with their time by kind of kernel. The profiler slows the host (each kernel
launched outside a graph is traced), so the wall times here run above the unprofiled ones; the GPU busy times
stand. The step windows are counted by one of the engine's ``observers``. Raw H200 output:
``results/gpu_busy_profile_h200.txt``.
"""

from __future__ import annotations

import collections
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from torchspec.bench import gpu_time
from torchspec.bench.w1 import SAMPLING, warmed_up
from torchspec.step import StepPlan

# What a decoder layer launches (the LM head's matmul counts with them): every named kind but compiled fusions.
LAYER_KINDS = frozenset(gpu_time.KERNEL_KINDS.values()) - {"fused elementwise (compiled)"}


def by_forward(kernels: list[gpu_time.Kernel], layers: int, shown: int = 12) -> None:
    """The window's first ``shown`` forwards, each its kernels from its first layer's RMSNorm to the next
    forward's (its sampling and the next forward's embedding included): busy time by kind (a round's verify is the
    forward with the most attention). Fused layers only (a forward launches ``2 * layers + 1`` RMSNorm kernels)."""
    forwards: list[list[gpu_time.Kernel]] = []
    norms = 2 * layers + 1
    seen = norms
    for kernel in sorted(kernels, key=lambda k: k.start_us):
        if "_rms_norm_kernel" in kernel.name:
            if seen == norms:
                forwards.append([])
                seen = 0
            seen += 1
        if forwards:
            forwards[-1].append(kernel)
    for forward in forwards[:shown]:
        times = collections.Counter()
        for kernel in forward:
            times[gpu_time.kernel_kind(kernel.name)] += kernel.end_us - kernel.start_us
        parts = ", ".join(f"{kind} {micros / 1e3:.2f}" for kind, micros in times.most_common())
        tqdm.write(f"   forward: {len(forward)} kernels, busy {gpu_time.busy_us(forward) / 1e3:.2f} ms ({parts})")
    if forwards:  # what a verify (the largest forward) and a draft launch besides their layers, dearest first
        shown_forwards = forwards[:shown]
        for label, forward in (("largest", max(shown_forwards, key=len)), ("smallest", min(shown_forwards, key=len))):
            counts, micros = collections.Counter(), collections.Counter()
            for kernel in forward:
                if gpu_time.kernel_kind(kernel.name) not in LAYER_KINDS:
                    counts[kernel.name[:70]] += 1
                    micros[kernel.name[:70]] += kernel.end_us - kernel.start_us
            listed = "; ".join(f"{counts[name]}x {us:.0f} us {name}" for name, us in micros.most_common())
            tqdm.write(
                f"   {label} forward, {sum(counts.values())} kernels outside its layers, "
                f"{sum(micros.values()) / 1e3:.2f} ms: {listed}"
            )


def report(prof: profile, wall_ms: float, unprofiled_ms: float, steps: int, layers: int) -> None:
    """Busy time (union of kernel intervals), span and kernel totals, per step; the idle share of the unprofiled
    steps just before the window (``unprofiled_ms``, as many steps: the profiler slows the host, so the window's
    own wall time overstates idleness; steps applied one after another in steady state are a step's wall time
    apart); then forward by forward."""
    kernels = gpu_time.kernels(prof)
    busy = gpu_time.busy_us(kernels)
    span = max(k.end_us for k in kernels) - min(k.start_us for k in kernels)
    totals, counts = collections.Counter(), collections.Counter()
    for kernel in kernels:
        totals[kernel.name[:60]] += kernel.end_us - kernel.start_us
        counts[kernel.name[:60]] += 1
    tqdm.write(
        f"WINDOW steps={steps} wall_ms_per_step={wall_ms / steps:.2f} gpu_busy_ms_per_step={busy / 1e3 / steps:.2f} "
        f"gpu_span_ms={span / 1e3 / steps:.2f} kernels_per_step={len(kernels) / steps:.0f} "
        f"unprofiled_wall_ms_per_step={unprofiled_ms / steps:.2f} "
        f"idle_of_unprofiled={1 - busy / 1e3 / unprofiled_ms:.1%}"
    )
    for name, micros in totals.most_common(22):
        tqdm.write(f"   {micros / 1e3 / steps:7.3f} ms/step {counts[name] / steps:6.1f}x  {name}")
    by_forward(kernels, layers)


def main() -> None:
    path, new_tokens, draft, windows, span, *rest = sys.argv[1:]
    starts, span = {int(step) for step in windows.split(",")}, int(span)
    if min(starts) <= span:
        sys.exit(f"a window starts after the {span} unprofiled steps timed before it: start windows past step {span}")
    options = json.loads(rest[0]) if rest else {}
    wrapped, prompts = warmed_up(path, draft, options)
    state = {"steps": 0, "profiler": None}
    applied: dict[int, float] = {}  # step number -> when it was applied, for the steps just before a window

    def windowed(plan: StepPlan, finished: list) -> None:
        """After each applied step: open a profile window at the chosen steps, close it ``span`` steps on."""
        state["steps"] += 1
        if any(0 <= start - state["steps"] <= span for start in starts):  # no sync: the steps keep overlapping
            applied[state["steps"]] = time.perf_counter()
        if state["steps"] in starts:
            requests = [item.request for item in plan.scheduled]
            context = sum(request.num_computed_tokens for request in requests) / max(1, len(requests))
            window = f"window at step {state['steps']}: batch {len(requests)} mean context {context:.0f}"
            tqdm.write(f"== {draft} {options} {window}")
            state["profiler"] = profile(activities=[ProfilerActivity.CUDA])
            state["profiler"].__enter__()
            state["start"] = time.perf_counter()
        elif state["profiler"] is not None and state["steps"] - span in starts:
            torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - state["start"])
            state["profiler"].__exit__(None, None, None)
            start = state["steps"] - span
            unprofiled_ms = 1e3 * (applied[start] - applied[start - span])
            report(state["profiler"], wall_ms, unprofiled_ms, span, wrapped.config.num_hidden_layers)
            state["profiler"] = None

    wrapped.engine.observers.append(windowed)
    torch.manual_seed(0)
    start = time.perf_counter()
    wrapped.generate_batch(prompts, max_new_tokens=int(new_tokens), min_new_tokens=int(new_tokens), **SAMPLING)
    stats = wrapped.last_stats
    print(f"total {time.perf_counter() - start:.1f} s; steps {stats.steps} mean accepted {stats.mean_accepted:.3f}")


if __name__ == "__main__":
    main()
