"""Where a CUDA graph capture's time goes, and which Triton kernels a run compiles (CUDA only).

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/capture_phases.py --model MODEL.gguf --max-new-tokens 2048 \
        --drafts pillar_recent

Runs ``torchspec.bench.throughput`` (same arguments) with every graph capture timed by phase and printed as a
``CAPTURE {json}`` line: waiting for the work in flight, the warm-up run (where a new kernel variant compiles),
a garbage collection and the allocator's cache release (what ``torch.cuda.graph`` may do on entry; timed here
on their own, so they are the script's cost, not the engine's), entering the capture, the captured run, and
instantiating the graph. Then lists the kernels compiled into ``TRITON_CACHE_DIR`` with their times (start
from an empty one to see what a fresh machine compiles, and when). Raw H200 output:
``results/capture_phases_h200.txt``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

import torchspec.cuda_graphs as cuda_graphs
from torchspec.bench import throughput

PHASES = ("inflight", "warmup", "gc", "empty", "enter", "body", "exit")  # "body": the captured run


def timed_capture(run, pool=None):
    """``cuda_graphs.capture_graph`` with each phase timed (the same warm-up and capture)."""
    marks = [time.perf_counter()]
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    before = torch.cuda.memory_stats()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    gc.collect()
    marks.append(time.perf_counter())
    torch.cuda.empty_cache()
    marks.append(time.perf_counter())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        marks.append(time.perf_counter())
        output = run()
        marks.append(time.perf_counter())
    marks.append(time.perf_counter())
    after = torch.cuda.memory_stats()
    spans = zip(PHASES, marks[:-1], marks[1:], strict=True)
    record = {
        "t": round(time.time(), 2),
        "ms": {phase: round(1e3 * (end - start), 1) for phase, start, end in spans},
        "retries": after["num_alloc_retries"] - before["num_alloc_retries"],
        "cuda_mallocs": after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
        "reserved_gib": round(after["reserved_bytes.all.current"] / 2**30, 2),
        "gc_objects": len(gc.get_objects()),
    }
    print("CAPTURE", json.dumps(record), flush=True)
    return graph, output


def compiled_kernels(cache: Path) -> list[tuple[float, str]]:
    """(modification time, kernel name) of every kernel in a Triton cache directory."""
    kernels = []
    for metadata in cache.glob("*/*.json"):
        if metadata.name.startswith("__grp__"):
            continue
        try:
            kernels.append((metadata.stat().st_mtime, json.loads(metadata.read_text()).get("name")))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(kernels)


def main() -> None:
    cuda_graphs.capture_graph = timed_capture
    throughput.main(sys.argv[1:])
    cache = os.environ.get("TRITON_CACHE_DIR")
    if cache:
        for when, name in compiled_kernels(Path(cache)):
            print(f"COMPILED {when:.2f} {name}")


if __name__ == "__main__":
    main()
