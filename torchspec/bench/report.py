"""The report of a ``torchspec bench`` run, written into one folder: ``results.json`` (every run's numbers with
the environment and options), ``report.md`` (a table a person reads) and PNG plots (tokens/s by method,
acceptance against context length, tokens/s against the swept value)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchspec.bench.runs import MethodRun
from torchspec.bench.throughput import CONTEXT_BIN_TOKENS

TOKENS_PLOT = "tokens_per_s.png"
ACCEPTANCE_PLOT = "acceptance_vs_context.png"


def new_figure(width: float = 8, height: float = 4.5) -> Any:
    """A matplotlib figure and its axes, drawn off screen (no pyplot: no global backend or figure state)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    return figure, figure.subplots()


def save_plot(figure: Any, axes: Any, path: Path, xlabel: str, ylabel: str) -> None:
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_ylim(0, None)
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_acceptance_vs_context(curves: Mapping[str, Sequence[dict]], path: Path, bin_tokens: int) -> None:
    """Mean accepted drafts per round against context length: one line per label, one point per context bin
    (``{context_from, mean_accepted}``, at the bin's middle)."""
    figure, axes = new_figure()
    for label, bins in curves.items():
        middles = [b["context_from"] + bin_tokens / 2 for b in bins]
        axes.plot(middles, [b["mean_accepted"] for b in bins], marker="o", label=label)
    axes.set_xlim(0, None)
    save_plot(figure, axes, path, "context length (tokens)", "accepted drafts per round")


def _label(run: MethodRun, sweep: str | None) -> str:
    return run.method if sweep is None else f"{run.method}, {sweep}={run.sweep_value}"


def _plot_tokens_per_s(runs: Sequence[MethodRun], path: Path, sweep: str | None) -> None:
    """Output tokens/s by method: a bar per method, one per swept value side by side."""
    methods = list(dict.fromkeys(run.method for run in runs))
    values = list(dict.fromkeys(run.sweep_value for run in runs))
    width = 0.8 / len(values)
    figure, axes = new_figure(max(6.0, 1.2 * len(methods) * len(values)))
    for offset, value in enumerate(values):
        chosen = {run.method: run.tokens_per_s for run in runs if run.sweep_value == value}
        xs = [methods.index(method) + (offset - (len(values) - 1) / 2) * width for method in chosen]
        bars = axes.bar(xs, list(chosen.values()), width, label=None if sweep is None else f"{sweep}={value}")
        axes.bar_label(bars, fmt="%.1f")
    axes.set_xticks(range(len(methods)), methods)
    save_plot(figure, axes, path, "method", "output tokens/s")


def _plot_sweep(runs: Sequence[MethodRun], path: Path, sweep: str) -> None:
    """Output tokens/s against the swept value, one line per method."""
    figure, axes = new_figure()
    for method in dict.fromkeys(run.method for run in runs):
        points = [(run.sweep_value, run.tokens_per_s) for run in runs if run.method == method]
        axes.plot(*zip(*points, strict=True), marker="o", label=method)
    save_plot(figure, axes, path, sweep, "output tokens/s")


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(runs: Sequence[MethodRun], sweep: str | None) -> list[str]:
    columns = [
        "method",
        "tok/s",
        "ms/token",
        "mean accepted",
        "peak GiB",
        "KV pool peak",
        "ms/step (host)",
        "warm-up s",
    ]
    if sweep is not None:
        columns.insert(1, sweep)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in runs:
        accepted = None if run.mean_accepted is None else f"{run.mean_accepted:.2f} of {run.k}"
        pool = None if run.peak_pool_tokens is None else f"{run.peak_pool_tokens} of {run.kv_capacity_tokens}"
        step = None if run.ms_per_step is None else f"{run.ms_per_step:.1f} ({run.host_ms_per_step:.1f})"
        cells = [run.method, f"{run.tokens_per_s:.1f}", f"{run.time_per_output_token_ms:.1f}"]
        cells += [accepted or "-", _cell(run.peak_memory_gib, 2), pool or "-", step or "-", _cell(run.warmup_s)]
        if sweep is not None:
            cells.insert(1, str(run.sweep_value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _acceptance(runs: Sequence[MethodRun], sweep: str | None) -> list[str]:
    speculative = [run for run in runs if run.accepted_histogram is not None]
    if not speculative:
        return []
    lines = [
        "",
        f"## Acceptance\nRounds that accepted 0, 1, ..., k drafts, and the mean accepted by context length "
        f"({CONTEXT_BIN_TOKENS}-token bins, rounds in parentheses).\n",
        "| run | rounds by drafts accepted | by context |",
        "|---|---|---|",
    ]
    for run in speculative:
        bins = ", ".join(
            f"{b['context_from']}+: {b['mean_accepted']:.2f} ({b['rounds']})" for b in run.acceptance_by_context or []
        )
        lines.append(f"| {_label(run, sweep)} | {run.accepted_histogram} | {bins} |")
    return lines


def _markdown(results: dict[str, Any], runs: Sequence[MethodRun], plots: Sequence[str], sweep: str | None) -> str:
    env, workload = results["environment"], results["workload"]
    shortest, mean, longest = workload["prompt_tokens_min_mean_max"]
    stops = "stopping at EOS" if workload["natural_lengths"] else "EOS held back"
    lines = [
        "# torchspec bench",
        "",
        f"Command: `{results['command']}`  ",
        f"Environment: {env['device']}, {env['dtype']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"triton {env['triton']}; CPU threads {env['threads']}, load average {env['load_average']} on "
        f"{env['cpus']} CPUs at the end (1 minute, this run included)  ",
        f"Workload: {workload['num_prompts']} prompts from {results['prompts']} in the chat template "
        f"({shortest}-{longest} tokens, mean {mean:.0f}), "
        f"{workload['output_len']} new tokens each ({stops}), temperature {workload['temperature']}, "
        f"{workload['batch_size']} requests at once, seed {workload['seed']}.  ",
        *([f"Swept: {sweep} (each run's value in the table, in place of the workload's).  "] if sweep else []),
        f"Warm-up: before its timed run each method decodes {workload['warmup_tokens']} tokens of every prompt, "
        "untimed (its wall time in the warm-up column).",
        "",
        *_table(runs, sweep),
        "",
        "tok/s: output tokens per second of wall time. ms/token: a request's latency (arrival to finish) over its "
        "output tokens, averaged over requests. Mean accepted: drafts accepted per verify round of k drafted (the "
        "verify's own token not counted). Peak GiB: device memory (CUDA only). KV pool peak: most KV slots held, "
        "of the pool's. ms/step: wall time per engine step, the host's CPU time in parentheses. '-': not reported "
        "by that method.",
        "",
        "## Configuration",
        *(f"- {run.method}: {run.configuration}" for run in {run.method: run for run in runs}.values()),
        *_acceptance(runs, sweep),
        "",
        *(f"![{plot}]({plot})" for plot in plots),
    ]
    return "\n".join(lines) + "\n"


def write_report(out: Path, runs: Sequence[MethodRun], results: dict[str, Any], sweep: str | None) -> list[Path]:
    """Write ``results.json``, ``report.md`` and the plots of ``runs`` into ``out``; ``results`` holds the
    command, environment, workload (:meth:`Workload.summary`), prompts (where they came from) and options.
    Returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    results = results | {"sweep": sweep, "runs": [dataclasses.asdict(run) for run in runs]}
    plots = [TOKENS_PLOT]
    _plot_tokens_per_s(runs, out / TOKENS_PLOT, sweep)
    curves = {_label(run, sweep): run.acceptance_by_context for run in runs if run.acceptance_by_context}
    if curves:
        plot_acceptance_vs_context(curves, out / ACCEPTANCE_PLOT, CONTEXT_BIN_TOKENS)
        plots.append(ACCEPTANCE_PLOT)
    if sweep is not None:
        plots.append(f"tokens_per_s_vs_{sweep.replace('-', '_')}.png")
        _plot_sweep(runs, out / plots[-1], sweep)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(_markdown(results, runs, plots, sweep))
    return [out / "results.json", out / "report.md", *(out / plot for plot in plots)]
