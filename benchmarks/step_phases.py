"""Each engine step of a W1 run by kind (plain, round, capture) and batch-size bucket: count, wall time, and the
host's time in each phase of the engine loop (CUDA only); then the same by ranges of steps, with the host's CPU
time and the garbage collector's pauses.

    python benchmarks/step_phases.py MODEL.gguf NEW_TOKENS DRAFT OUT.json ['{"engine": "options"}']

Runs W1's prompts (256, T=0.65, EOS held back) with ``DRAFT`` after a 16-token warm-up and logs every step as
it is applied: its scheduled requests, round length, wall time since the last step applied, whether a graph was
captured in between, and the host's milliseconds in each phase of the engine loop over that interval
(``Engine.host_ms``: planning, launching, reading back, which holds the wait for the device, and committing; the
engine plans and launches step N + 1 before it applies step N, so one interval holds the next step's planning and
this one's commit), the main thread's CPU time and the garbage collector's pauses over it. Writes
the per-step log to ``OUT.json`` and prints, per bucket of scheduled requests (powers of two), each kind's
count, total and median wall time, and the median host time of each phase; then, per ``STEP_RANGE`` steps, the
mean, median and largest wall time, the median of each phase, the CPU time and the collector's time per step
(the wait for the device spins, so it counts as CPU time too; in stretches where the host sets the pace, CPU time
below the wall time is a host held off its core, CPU time equal to it a host whose work took longer); and the CUDA
caching allocator's driver calls over the run. It watches the run as one of the engine's ``observers``. Raw
output: ``results/step_phases_h200.txt`` (H200, by bucket), ``results/step_phases_none_h100.txt`` (two H100s, W1's
plain decoding by range).
"""

from __future__ import annotations

import collections
import gc
import itertools
import json
import statistics
import sys
import time

from torchspec.bench.throughput import allocator_calls_since, allocator_counters
from torchspec.bench.w1 import SAMPLING, warmed_up
from torchspec.step import StepPlan

#: The log's name of each phase of the engine loop (``Engine.host_ms``: its host milliseconds, accumulated).
PHASES = {"sched": "schedule", "launch": "launch", "wait": "read-back", "commit": "commit"}
STEP_RANGE = 100  # steps a row of the by-range view covers


def summary(log: list[dict]) -> None:
    """Per bucket and kind: count, total and median wall time; median host ms per phase."""
    groups: dict[int, dict[str, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for before, step in itertools.pairwise(log):
        kind = "capture" if step["captures"] != before["captures"] else "round" if step["length"] else "plain"
        groups[1 << (step["batch"] - 1).bit_length()][kind].append(step)
    for bucket in sorted(groups, reverse=True):
        kinds = groups[bucket]
        walls = {kind: [step["ms"] for step in steps] for kind, steps in kinds.items()}
        print(
            f"bucket<={bucket:4d} "
            + "  ".join(
                f"{kind}: n={len(ms)} sum={sum(ms) / 1e3:.2f}s med={statistics.median(ms):.1f}ms"
                for kind, ms in walls.items()
            )
        )
        print(
            "      host med ms: "
            + "  ".join(
                f"{kind}.{phase}={statistics.median(step[phase] for step in steps):.1f}"
                for kind, steps in kinds.items()
                for phase in PHASES
            )
        )


def by_range(log: list[dict]) -> None:
    """Per ``STEP_RANGE`` steps of the log: wall ms per step (mean, median, largest), median host ms per phase, and
    mean CPU ms and garbage-collector ms per step, with the collector's passes (all generations, then full ones)."""
    for first in range(0, len(log), STEP_RANGE):
        steps = log[first : first + STEP_RANGE]
        walls = [step["ms"] for step in steps]
        phases = " ".join(f"{key} {statistics.median(step[key] for step in steps):.2f}" for key in PHASES)
        collector = f"{sum(step['gc_passes'] for step in steps)} passes, {sum(step['gc_full'] for step in steps)} full"
        print(
            f"steps {first}-{first + len(steps) - 1}: wall mean {statistics.fmean(walls):.2f} "
            f"median {statistics.median(walls):.2f} max {max(walls):.1f} | median {phases} | "
            f"cpu {statistics.fmean(step['cpu'] for step in steps):.2f} "
            f"gc {statistics.fmean(step['gc'] for step in steps):.3f} ({collector})"
        )


class CollectorClock:
    """The garbage collector's pauses, as ``gc.callbacks`` report them: milliseconds, passes and full passes so far."""

    def __init__(self) -> None:
        self.ms, self.passes, self.full = 0.0, 0, 0
        self._started = 0.0
        gc.callbacks.append(self._on_pass)

    def _on_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.ms += 1e3 * (time.perf_counter() - self._started)
        self.passes += 1
        self.full += info["generation"] == 2

    def now(self) -> tuple[float, int, int]:
        return self.ms, self.passes, self.full


def main() -> None:
    path, new_tokens, draft, out, *rest = sys.argv[1:]
    options = json.loads(rest[0]) if rest else {}
    wrapped, prompts = warmed_up(path, draft, options)
    log: list[dict] = []
    engine = wrapped.engine
    collector = CollectorClock()
    last = {
        "at": time.perf_counter(),
        "host_ms": dict(engine.host_ms),
        "cpu": time.thread_time(),
        "gc": collector.now(),
    }

    def logged(plan: StepPlan, finished: list) -> None:
        """After each applied step: its requests, round length, wall time, host ms per phase, CPU ms and garbage
        collection since the last."""
        now, host_ms, cpu, collected = time.perf_counter(), dict(engine.host_ms), time.thread_time(), collector.now()
        since = last["host_ms"] if last["at"] > engine.run_start else dict.fromkeys(host_ms, 0.0)  # a new run
        gc_ms, gc_passes, gc_full = (now_value - was for now_value, was in zip(collected, last["gc"], strict=True))
        log.append(
            dict(
                batch=len(plan.scheduled),
                length=plan.round_length,
                captures=engine.runner.num_captures,
                ms=1e3 * (now - max(last["at"], engine.run_start)),
                **{key: host_ms[phase] - since[phase] for key, phase in PHASES.items()},
                cpu=1e3 * (cpu - last["cpu"]),
                gc=gc_ms,
                gc_passes=gc_passes,
                gc_full=gc_full,
            )
        )
        last.update(at=now, host_ms=host_ms, cpu=cpu, gc=collected)

    engine.observers.append(logged)
    allocator_before = allocator_counters(engine.device)
    start = time.perf_counter()
    wrapped.generate_batch(prompts, max_new_tokens=int(new_tokens), min_new_tokens=int(new_tokens), **SAMPLING)
    print(f"{draft} {options}: {time.perf_counter() - start:.1f} s, steps {len(log)}")
    allocator_calls = allocator_calls_since(allocator_before, engine.device)
    with open(out, "w") as file:
        json.dump(log, file)
    summary(log)
    by_range(log)
    print("allocator calls: " + ", ".join(f"{name} {count}" for name, count in allocator_calls.items()))


if __name__ == "__main__":
    main()
