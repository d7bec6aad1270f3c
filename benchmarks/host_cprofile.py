"""Where the host's time goes in steady full-batch steps: ``cProfile`` over a window of engine steps (CUDA).

    python -m benchmarks.host_cprofile MODEL.gguf NEW_TOKENS DRAFT FIRST_STEP STEPS [BATCH]

Runs W1's prompts (256, T=0.65, EOS held back; ``BATCH`` of them with ``max_batch_size=BATCH``, cycling the packaged
705 past that: 1024 is W3's batch) with ``DRAFT`` (``none`` or a policy) after a 64-token warm-up,
and profiles the host from the ``FIRST_STEP``-th step applied after it for ``STEPS`` steps (counted by one of the
engine's ``observers``); prints the functions by their own time, then the engine's by cumulative time. The profiler
slows Python-heavy code (its times run above unprofiled ones), so compare runs of this script, not its times with a
benchmark's. Raw H200 output: ``results/host_cprofile_h200.txt``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
from tqdm import tqdm

from torchspec import sparsespec
from torchspec.models import load_model
from torchspec.step import StepPlan
from torchspec.workloads import reasoning_prompt_ids


def main() -> None:
    path, draft = sys.argv[1], sys.argv[3]
    new_tokens, first, count = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 256
    model, tokenizer = load_model(path, dtype=torch.bfloat16, device="cuda")
    prompts = [list(prompt) for prompt in reasoning_prompt_ids(tokenizer, batch)]
    wrapped = sparsespec.wrap(model, draft=None if draft == "none" else draft, max_batch_size=batch)
    sampling = {"do_sample": True, "temperature": 0.65}
    wrapped.generate_batch(prompts, max_new_tokens=64, min_new_tokens=64, **sampling)
    profiler, applied, started = cProfile.Profile(), [0], [0.0]

    def window(plan: StepPlan, finished: list) -> None:
        """After each applied step: profile from the ``first``-th on, for ``count`` steps."""
        applied[0] += 1
        if applied[0] == first:
            started[0] = time.perf_counter()
            profiler.enable()
        elif applied[0] == first + count:
            profiler.disable()
            wall = 1e3 * (time.perf_counter() - started[0]) / count
            batch = len(plan.scheduled)
            tqdm.write(f"{draft}: {count} steps profiled, the last at batch {batch}, {wall:.1f} ms each (profiled)")

    wrapped.engine.observers.append(window)
    wrapped.generate_batch(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sampling)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats("torchspec", 40)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
