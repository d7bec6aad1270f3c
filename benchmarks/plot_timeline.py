"""Throughput runs over their time: requests per step, wall time per step and the host's in each phase of the
engine's steps (where the records trace it), K/V tokens held on the device and in the host tier, and tokens moved
to the host and back, from the records' ``timeline`` (where an ``offload`` run's batch grows, shrinks or waits on
memory, issue 15; where a W1 step's time goes as its contexts grow, and when the host sets its pace, issue 14).

    python -m benchmarks.plot_timeline RECORDS.jsonl OUT.png [SETTING ...]

Plots every record of ``RECORDS.jsonl`` (``python -m torchspec.bench.throughput ... --out RECORDS.jsonl``), or
those whose ``setting`` is named (e.g. ``pillar_recent pillar_recent+offload``), one colour each.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

from torchspec.bench.records import record_setting
from torchspec.bench.throughput import HOST_TRACE_FIELDS, TRACE_POINTS, trace_steps
from torchspec.engine import HOST_PHASES

HOST_STYLES = ("--", "-.", ":", (0, (1, 4)))  # one line style per host phase (schedule, launch, read-back, commit)


def timelines(path: Path, settings: list[str]) -> list[tuple[str, dict[str, list]]]:
    """(label, timeline) of each record that has one, in file order, of the named settings (all when none); each
    timeline also gets ``ms_per_step`` (see ``step_times``)."""
    found = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        setting = record_setting(record)
        if record.get("timeline") and (not settings or setting in settings):
            timeline = record["timeline"] | {
                "ms_per_step": step_times(record["timeline"]["seconds"], record["steps"]),
                "steps": record["steps"],
            }
            found.append((f"{setting} ({record['tokens_per_s']:,.0f} tok/s)", timeline))
    return found


def step_times(seconds: list[float], steps: int, scale: float = 1e3) -> list[float | None]:
    """Per step from each trace point to the next (None at the last), the trace keeping the steps ``trace_steps``
    names: how much a cumulative trace field (``seconds``, times ``scale``: wall milliseconds) grew a step."""
    indices = trace_steps(steps, TRACE_POINTS)
    if len(indices) != len(seconds):
        raise ValueError(f"a trace of {len(seconds)} points does not sample {steps} steps as sampled_trace does")
    times = zip(itertools.pairwise(seconds), itertools.pairwise(indices), strict=True)
    return [scale * (end - start) / (last - first) for (start, end), (first, last) in times] + [None]


def plot(runs: list[tuple[str, dict[str, list]]], out: Path) -> None:
    moving = any(any(line["offloaded_tokens"]) for _, line in runs)  # a panel of moves only where some run moved
    figure = Figure(figsize=(9, 10 if moving else 7.5))
    requests, step_ms, held, *moved = figure.subplots(4 if moving else 3, 1, sharex=True)
    colours = [f"C{i}" for i in range(len(runs))]
    for (label, line), colour in zip(runs, colours, strict=True):
        seconds = line["seconds"]
        requests.plot(seconds, line["requests"], color=colour, label=label)
        step_ms.plot(seconds[:-1], line["ms_per_step"][:-1], color=colour, label=label)
        for phase, field, style in zip(HOST_PHASES, HOST_TRACE_FIELDS, HOST_STYLES, strict=True):
            if field in line:  # records from before the host's phases were traced have none
                per_step = step_times(line[field], line["steps"], scale=1.0)[:-1]
                step_ms.plot(seconds[:-1], per_step, color=colour, linestyle=style, lw=0.8, label=f"host {phase}")
        held.plot(seconds, [n / 1e6 for n in line["pool_tokens"]], color=colour, label=f"{label}: device pool")
        if any(line["host_tokens"]):
            held.plot(seconds, [n / 1e6 for n in line["host_tokens"]], color=colour, linestyle="--", label="host tier")
        if any(line["offloaded_tokens"]):
            sent, back = ([n / 1e6 for n in line[name]] for name in ("offloaded_tokens", "restored_tokens"))
            moved[0].plot(seconds, sent, color=colour, label=f"{label}: to host")
            moved[0].plot(seconds, back, color=colour, linestyle=":", label="back")
    panels = [(requests, "requests in the step"), (step_ms, "ms per step"), (held, "K/V tokens held (M)")]
    for axes, ylabel in panels + [(axes, "moved (M)") for axes in moved]:
        axes.set_ylabel(ylabel)
        axes.set_ylim(0, None)
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)
    (moved or [held])[0].set_xlabel("seconds into the run")
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main(argv: list[str]) -> None:
    records, out, *settings = argv
    runs = timelines(Path(records), settings)
    if not runs:
        named = f" for {', '.join(settings)}" if settings else ""
        raise SystemExit(f"no record with a timeline in {records}{named}")
    plot(runs, Path(out))
    print(f"{out}: {len(runs)} runs")


if __name__ == "__main__":
    main(sys.argv[1:])
