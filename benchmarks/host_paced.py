"""How much of a run's wall time is above its GPU's work, and where (issue 14: when the host sets the pace).

    python -m benchmarks.host_paced RECORDS.jsonl SETTING PROFILE.txt

Reads the last record of ``SETTING`` (its ``timeline``: wall time per step over the run) and a GPU busy profile of
the same workload (``benchmarks/gpu_busy_profile.py``: the GPU's busy ms per step at a few steps; the windows of the
setting's draft, whatever their options), fits the GPU's busy time per step as piecewise linear in the step
(extended linearly past the profiled steps: a plain step's work grows with its context, one token a step), and
prints, by ranges of steps, the wall seconds against the GPU's; then the tokens per second the run would make if
every step took its GPU work alone.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

from torchspec.bench.records import parse_setting, record_setting
from torchspec.bench.throughput import TRACE_POINTS, trace_steps

STEP_RANGE = 1000  # steps a row of the report covers
_WINDOW = re.compile(r"== (\S+) .*window at step (\d+):.*\nWINDOW .*gpu_busy_ms_per_step=([\d.]+)")


def busy_points(profile: str, draft: str) -> list[tuple[int, float]]:
    """(step, GPU busy ms a step) of each window of ``draft``'s runs in a gpu_busy_profile report, by step."""
    return sorted((int(step), float(ms)) for name, step, ms in _WINDOW.findall(profile) if name == draft)


def busy_ms(points: list[tuple[int, float]], step: int) -> float:
    """The GPU's busy ms at ``step``: linear between the profiled steps around it, or through the nearest two."""
    if len(points) < 2:
        raise ValueError("a fit needs at least two profiled steps")
    right = next((i for i, (at, _) in enumerate(points) if i and at >= step), len(points) - 1)
    (x0, y0), (x1, y1) = points[right - 1], points[right]
    return y0 + (y1 - y0) * (step - x0) / (x1 - x0)


def report(record: dict, points: list[tuple[int, float]]) -> list[str]:
    """The report's lines (see the module docstring)."""
    seconds, steps = record["timeline"]["seconds"], record["steps"]
    indices = trace_steps(steps, TRACE_POINTS)
    rows: dict[int, list[float]] = {}  # range -> [wall s, GPU s]
    for (first, last), (start, end) in zip(itertools.pairwise(indices), itertools.pairwise(seconds), strict=True):
        row = rows.setdefault(first // STEP_RANGE, [0.0, 0.0])
        row[0] += end - start
        row[1] += sum(busy_ms(points, step) for step in range(first, last)) / 1e3
    lines = [
        f"steps {k * STEP_RANGE}-{(k + 1) * STEP_RANGE - 1}: wall {w:.1f} s, GPU {g:.1f} s"
        for k, (w, g) in rows.items()
    ]
    wall, gpu = (sum(row[i] for row in rows.values()) for i in (0, 1))
    above = sum(max(0.0, w - g) for w, g in rows.values())
    tokens, before = record["generated_tokens"], seconds[0]  # before the first step's end: prompts, captures
    lines.append(f"all: wall {wall:.1f} s, GPU {gpu:.1f} s; wall above the GPU's work {above:.1f} s")
    lines.append(f"if GPU-bound: {tokens / (before + gpu):,.0f} tok/s (the run: {record['tokens_per_s']:,.0f})")
    return lines


def main(argv: list[str]) -> None:
    records, setting, profile = argv
    found = [r for r in map(json.loads, Path(records).read_text().splitlines()) if record_setting(r) == setting]
    if not found or not found[-1].get("timeline"):
        raise SystemExit(f"no record of {setting} with a timeline in {records}")
    draft = parse_setting(setting)[0] or "none"
    print("\n".join(report(found[-1], busy_points(Path(profile).read_text(), draft))))


if __name__ == "__main__":
    main(sys.argv[1:])
