"""Does emptying the allocator's caches on every capture cost a draining batch? (CUDA only.)

    python -m benchmarks.capture_ab OUT.jsonl   # from the repository root

``torch.cuda.graph`` synchronises the device and empties the device and pinned-host caches on entry, made for
captures at start-up; the engine captures mid-run, at every new bucket. This runs the engine's capture as it is
(``cuda_graphs.capture_graph``) and a variant that captures with ``CUDAGraph.capture_begin`` / ``capture_end``
on the side stream instead (no cache emptied), alternately, each on a fresh random SmolLM2-shaped model
(pillar_recent, T=0.65, 40 new tokens) through batches of 256 down to 1 prompts of 64 random tokens, so each
bucket captures its graphs; it appends per variant the wall time, the captures and their seconds. The first
variant also pays the process's first kernel loads. Raw H200 output: ``results/capture_ab_h200.jsonl``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from benchmarks.step_profile import random_model
from torchspec import cuda_graphs, sparsespec

BATCHES = (256, 160, 96, 48, 24, 12, 6, 3, 1)


def capture_without_emptying(run, pool=None):
    """``cuda_graphs.capture_graph`` with the capture begun and ended by hand: no device-wide synchronisation,
    no emptied caches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            output = run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, output


def main() -> None:
    engine_capture = cuda_graphs.capture_graph
    generator = torch.Generator().manual_seed(0)
    with open(sys.argv[1], "a") as out:
        for name, capture in (("torch.cuda.graph", engine_capture), ("capture_begin", capture_without_emptying)) * 2:
            cuda_graphs.capture_graph = capture
            model = random_model(torch.device("cuda"), torch.bfloat16)
            wrapped = sparsespec.wrap(model, draft="pillar_recent", max_batch_size=256, kv_capacity_tokens=100_000)
            log = wrapped.engine.runner.graphs.captures  # step and chain graphs share it
            start = time.perf_counter()
            for batch in BATCHES:
                prompts = [torch.randint(0, 49152, (64,), generator=generator).tolist() for _ in range(batch)]
                wrapped.generate_batch(prompts, max_new_tokens=40, min_new_tokens=40, do_sample=True, temperature=0.65)
            torch.cuda.synchronize()
            record = dict(variant=name, seconds=time.perf_counter() - start, captures=log.count, capture_s=log.seconds)
            print(record, flush=True)
            out.write(json.dumps(record) + "\n")
            del wrapped, model
            torch.cuda.empty_cache()
    cuda_graphs.capture_graph = engine_capture


if __name__ == "__main__":
    main()
