"""Each engine step of a W1 run by kind (plain, round, capture) and batch-size bucket: count, wall time, and the
host's time in each phase of the engine loop (CUDA only).

    python benchmarks/step_phases.py MODEL.gguf NEW_TOKENS DRAFT OUT.json ['{"engine": "options"}']

Runs W1's prompts (256, T=0.65, EOS held back) with ``DRAFT`` after a 16-token warm-up and logs every step as
it is applied: its scheduled requests, round length, wall time since the last step applied, whether a graph was
captured in between, and the host's milliseconds in each phase of the engine loop over that interval
(``Engine.host_ms``: planning, launching, reading back, which holds the wait for the device, and committing; the
engine plans and launches step N + 1 before it applies step N, so one interval holds the next step's planning and
this one's commit). Writes
the per-step log to ``OUT.json`` and prints, per bucket of scheduled requests (powers of two), each kind's
count, total and median wall time, and the median host time of each phase. It watches the run as one of the
engine's ``observers``. Raw H200 output: ``results/step_phases_h200.txt``.
"""

from __future__ import annotations

import collections
import itertools
import json
import statistics
import sys
import time

from torchspec.bench.w1 import SAMPLING, warmed_up
from torchspec.scheduler import StepPlan

#: The log's name of each phase of the engine loop (``Engine.host_ms``: its host milliseconds, accumulated).
PHASES = {"sched": "schedule", "launch": "launch", "wait": "read-back", "commit": "commit"}


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


def main() -> None:
    path, new_tokens, draft, out, *rest = sys.argv[1:]
    options = json.loads(rest[0]) if rest else {}
    wrapped, prompts = warmed_up(path, draft, options)
    log: list[dict] = []
    engine = wrapped.engine
    last = {"at": time.perf_counter(), "host_ms": dict(engine.host_ms)}

    def logged(plan: StepPlan, finished: list) -> None:
        """After each applied step: its requests, round length, wall time and host ms per phase since the last."""
        now, host_ms = time.perf_counter(), dict(engine.host_ms)
        since = last["host_ms"] if last["at"] > engine.run_start else dict.fromkeys(host_ms, 0.0)  # a new run
        log.append(
            dict(
                batch=len(plan.scheduled),
                length=plan.round_length,
                captures=engine.runner.num_captures,
                ms=1e3 * (now - max(last["at"], engine.run_start)),
                **{key: host_ms[phase] - since[phase] for key, phase in PHASES.items()},
            )
        )
        last.update(at=now, host_ms=host_ms)

    engine.observers.append(logged)
    start = time.perf_counter()
    wrapped.generate_batch(prompts, max_new_tokens=int(new_tokens), min_new_tokens=int(new_tokens), **SAMPLING)
    print(f"{draft} {options}: {time.perf_counter() - start:.1f} s, steps {len(log)}")
    with open(out, "w") as file:
        json.dump(log, file)
    summary(log)


if __name__ == "__main__":
    main()
