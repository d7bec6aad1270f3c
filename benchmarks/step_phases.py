"""Each engine step of a W1 run by kind (plain, round, capture) and batch-size bucket: count, wall time, and the
host's time in each phase of the engine loop (CUDA only).

    python benchmarks/step_phases.py MODEL.gguf NEW_TOKENS DRAFT OUT.json ['{"engine": "options"}']

Runs W1's prompts (256, T=0.65, EOS held back) with ``DRAFT`` after a 16-token warm-up and logs every step as
it is applied: its scheduled requests, round length, wall time since the last step applied, whether a graph was
captured in between, and the host's milliseconds in ``Scheduler.schedule``, ``Runner.launch``, waiting on the
read-back (``_Readback.tolist``) and ``Scheduler.commit`` over that interval (the engine plans and launches step
N + 1 before it applies step N, so one interval holds the next step's planning and this one's commit). Writes
the per-step log to ``OUT.json`` and prints, per bucket of scheduled requests (powers of two), each kind's
count, total and median wall time, and the median host time of each phase. The wrappers are a diagnostic, not
engine options. Raw H200 output: ``results/step_phases_h200.txt``.
"""

from __future__ import annotations

import collections
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable

from torchspec import engine, runner, scheduler
from torchspec.bench.w1 import SAMPLING, warmed_up

PHASES = {
    "sched": (scheduler.Scheduler, "schedule"),
    "launch": (runner.Runner, "launch"),
    "wait": (runner._Readback, "tolist"),
    "commit": (scheduler.Scheduler, "commit"),
}


def timed(owner: type, name: str, spent: collections.Counter, key: str) -> None:
    """Wrap ``owner.name`` so that its host seconds add up in ``spent[key]``."""
    function: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


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
    spent: collections.Counter = collections.Counter()
    for key, (owner, name) in PHASES.items():
        timed(owner, name, spent, key)
    log: list[dict] = []
    commit = engine.Engine._commit
    last = [time.perf_counter()]

    def logged_commit(self, scheduler, step):
        result = commit(self, scheduler, step)
        now = time.perf_counter()
        log.append(
            dict(
                batch=len(step.plan.scheduled),
                length=step.plan.round_length,
                captures=self.runner.num_captures,
                ms=1e3 * (now - last[0]),
                **{key: 1e3 * spent[key] for key in PHASES},
            )
        )
        last[0] = now
        spent.clear()
        return result

    engine.Engine._commit = logged_commit
    start = time.perf_counter()
    wrapped.generate_batch(prompts, max_new_tokens=int(new_tokens), min_new_tokens=int(new_tokens), **SAMPLING)
    print(f"{draft} {options}: {time.perf_counter() - start:.1f} s, steps {len(log)}")
    with open(out, "w") as file:
        json.dump(log, file)
    summary(log)


if __name__ == "__main__":
    main()
