"""Where a steady step's host time goes, function by function, without a profiler's overhead (CUDA).

    python -m benchmarks.host_split MODEL.gguf NEW_TOKENS DRAFT FIRST_STEP STEPS [OPS_STEPS]

Runs W1's prompts (256, T=0.65, EOS held back) with ``DRAFT`` (``none`` or a policy) after a 16-token warm-up.
From the ``FIRST_STEP``-th step applied for ``STEPS`` steps, the engine's step functions (``TIMED``) are wrapped
with a clock each (a ``perf_counter`` pair a call, ~1 us): printed is each one's inclusive host milliseconds per
step, beside the engine's own phases (``Engine.host_ms``) and the wall time per step over the window. cProfile
(``host_cprofile.py``) slows Python-heavy code 3x, which hides what a GPU op's dispatch costs against the Python
around it; these clocks do not. Then ``OPS_STEPS`` (default 20) more steps run under ``torch.profiler`` (CPU
only): the operators by their own host time per step, and how many kernel launches and copies a step makes.
Raw output: ``results/host_split_none_h100.txt``.
"""

from __future__ import annotations

import collections
import functools
import sys
import time

from torch.profiler import ProfilerActivity, profile

from torchspec import sampling, token_picks
from torchspec.bench.w1 import SAMPLING, warmed_up
from torchspec.cuda_graphs import StepGraphs
from torchspec.runner import Runner
from torchspec.scheduler import Scheduler
from torchspec.slot_table import SlotTable
from torchspec.step import StepPlan
from torchspec.step_metadata import MetadataBuilder
from torchspec.token_picks import TokenPicker

#: (owner, attribute) of each function timed: the engine loop's calls and what they call, outermost first.
TIMED = [
    (Scheduler, "schedule"),
    (Runner, "move_kv"),
    (Runner, "launch"),
    (MetadataBuilder, "shifts"),
    (MetadataBuilder, "round_lists"),
    (MetadataBuilder, "build"),
    (SlotTable, "gather"),
    (Runner, "_forward"),
    (StepGraphs, "_fill"),
    (Runner, "_learn_from_verify"),
    (Runner, "_draft_sampling"),
    (TokenPicker, "pick"),
    (token_picks, "suppress_stop_tokens"),
    (token_picks, "target_probs"),
    (sampling, "top_k_cutoff"),
    (TokenPicker, "_accept"),
    (Runner, "_advance"),
    (Runner, "_later_drafts"),
    (Runner, "_verify_rounds"),
    (Runner, "collect"),
    (Scheduler, "commit"),
]


class Clocks:
    """Inclusive seconds and calls of each timed function while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}".removeprefix("torchspec.")

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)


def main() -> None:
    path, new_tokens, draft = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    first, count = int(sys.argv[4]), int(sys.argv[5])
    ops_steps = int(sys.argv[6]) if len(sys.argv) > 6 else 20
    wrapped, prompts = warmed_up(path, draft, {})
    engine = wrapped.engine
    clocks = Clocks()
    for owner, name in TIMED:
        clocks.wrap(owner, name)
    applied, window = [0], {}
    profiler = profile(activities=[ProfilerActivity.CPU])

    def watch(plan: StepPlan, finished: list) -> None:
        """After each applied step: the clocks on from ``first`` for ``count`` steps, then the profiler."""
        applied[0] += 1
        if applied[0] == first:
            clocks.on = True
            window.update(start=time.perf_counter(), host_ms=dict(engine.host_ms))
        elif applied[0] == first + count:
            clocks.on = False
            window.update(wall=time.perf_counter() - window["start"], batch=len(plan.scheduled))
            window["phases"] = {k: v - window["host_ms"][k] for k, v in engine.host_ms.items()}
            profiler.start()
        elif applied[0] == first + count + ops_steps:
            profiler.stop()

    engine.observers.append(watch)
    wrapped.generate_batch(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **SAMPLING)
    print(
        f"{draft}: steps {first}-{first + count - 1}, batch {window['batch']} at the end: "
        f"{1e3 * window['wall'] / count:.3f} ms a step of wall time"
    )
    print("engine phases, ms a step: " + ", ".join(f"{k} {v / count:.3f}" for k, v in window["phases"].items()))
    for label, seconds in clocks.seconds.items():
        print(f"  {label:34s} {1e3 * seconds / count:7.3f} ms a step, {clocks.calls[label] / count:5.2f} calls")
    averages = profiler.key_averages()
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    copies = sum(e.count for e in averages if e.key.startswith("cudaMemcpy"))
    print(
        f"per step over {ops_steps} steps: {launches / ops_steps:.1f} kernel launches, {copies / ops_steps:.1f} copies"
    )
    rows = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:30]
    for e in rows:
        self_ms = e.self_cpu_time_total / 1e3 / ops_steps
        print(f"  {e.key[:48]:48s} {e.count / ops_steps:6.1f} calls {self_ms:7.3f} ms self")


if __name__ == "__main__":
    main()
