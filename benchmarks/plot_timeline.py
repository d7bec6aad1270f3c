"""Throughput runs over their time: requests per step, K/V tokens held on the device and in the host tier, and
tokens moved to the host and back, from the records' ``timeline`` (where an ``offload`` run's batch grows,
shrinks or waits on memory; issue 15).

    python benchmarks/plot_timeline.py RECORDS.jsonl OUT.png [SETTING ...]

Plots every record of ``RECORDS.jsonl`` (``python -m torchspec.bench.throughput ... --out RECORDS.jsonl``), or
those whose ``setting`` is named (e.g. ``pillar_recent pillar_recent+offload``), one colour each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.figure import Figure


def timelines(path: Path, settings: list[str]) -> list[tuple[str, dict[str, list]]]:
    """(label, timeline) of each record that has one, in file order, of the named settings (all when none)."""
    found = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        setting = record.get("setting") or str(record.get("draft"))
        if record.get("timeline") and (not settings or setting in settings):
            found.append((f"{setting} ({record['tokens_per_s']:,.0f} tok/s)", record["timeline"]))
    return found


def plot(runs: list[tuple[str, dict[str, list]]], out: Path) -> None:
    figure = Figure(figsize=(9, 8))
    requests, held, moved = figure.subplots(3, 1, sharex=True)
    colours = [f"C{i}" for i in range(len(runs))]
    for (label, line), colour in zip(runs, colours, strict=True):
        seconds = line["seconds"]
        requests.plot(seconds, line["requests"], color=colour, label=label)
        held.plot(seconds, [n / 1e6 for n in line["pool_tokens"]], color=colour, label=f"{label}: device pool")
        if any(line["host_tokens"]):
            held.plot(seconds, [n / 1e6 for n in line["host_tokens"]], color=colour, linestyle="--", label="host tier")
        if any(line["offloaded_tokens"]):
            moved.plot(seconds, [n / 1e6 for n in line["offloaded_tokens"]], color=colour, label=f"{label}: to host")
            moved.plot(seconds, [n / 1e6 for n in line["restored_tokens"]], color=colour, linestyle=":", label="back")
    for axes, ylabel in ((requests, "requests in the step"), (held, "K/V tokens held (M)"), (moved, "moved (M)")):
        axes.set_ylabel(ylabel)
        axes.set_ylim(0, None)
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)
    moved.set_xlabel("seconds into the run")
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
