"""Measure draft acceptance of every draft policy on the same engine, prompts and budget.

``python -m torchspec.bench.acceptance --prompts 4 --max-new-tokens 1536 --out docs/acceptance.md``
runs greedy generation per policy (k=8, sparsity=0.05, min_budget=128 by default), checks each output
equals plain decoding token for token, and writes a table of mean accepted drafts per round (bonus token
not counted), overall and by context length, plus a plot of acceptance against context length.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchspec import sparsespec
from torchspec.bench.report import plot_acceptance_vs_context
from torchspec.bench.throughput import context_bins
from torchspec.config import DRAFT_POLICIES
from torchspec.models import load_model
from torchspec.workloads import reasoning_prompt_ids

#: Context-length buckets of the table: [low, high).
BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, None))


@dataclass(frozen=True)
class Variant:
    label: str
    options: dict


def default_variants() -> list[Variant]:
    """Every registered policy at its defaults, the paper's PillarAttn with one of pillar_recent's two additions
    at a time (the ablation), pillar_recent with head budgets or learning from every other round, and the query
    sketch draft (by default its later drafts rescore an 8x shortlist) with other shortlists and with successors.
    (Session 19-20's other key sketches and refresh intervals: ``torchspec.bench.acceptance`` at b06bb76.)"""
    variants = [Variant(name, {"draft": name}) for name in DRAFT_POLICIES]
    variants.append(Variant("pillar + recent 64", {"draft": "pillar", "recent_window": 64}))
    variants.append(Variant("pillar + successors 4", {"draft": "pillar", "successors": 4}))
    variants.append(Variant("pillar_recent + head budgets", {"draft": "pillar_recent", "head_budgets": True}))
    variants.append(Variant("pillar_recent + relearn 2", {"draft": "pillar_recent", "relearn_rounds": 2}))
    for shortlist in (0, 2, 4):  # 0: every draft scores every older position
        options = {"draft": "query_sketch", "sketch_shortlist": shortlist}
        variants.append(Variant(f"query_sketch, shortlist {shortlist}x", options))
    variants.append(Variant("query_sketch + successors 4", {"draft": "query_sketch", "successors": 4}))
    return variants  # pillar_recent (a registered policy) is pillar + recent 64 + successors 4


def bucket_label(low: int, high: int | None) -> str:
    return f">={low}" if high is None else (f"<{high}" if low == 0 else f"{low}-{high - 1}")


def measure(model, prompts: list[list[int]], max_new_tokens: int, baseline: list, variant: Variant, **spec) -> dict:
    """Generate with one variant; return its per-round (context, accepted) pairs and a lossless check."""
    wrapped = sparsespec.wrap(model, **spec, **variant.options)
    start = time.perf_counter()
    outputs = wrapped.generate_batch(
        prompts, max_new_tokens=max_new_tokens, do_sample=False, progress_bar=True
    ).values()
    elapsed = time.perf_counter() - start
    rounds = [
        (context, accepted)
        for output in outputs
        for context, accepted in zip(
            output.stats.speculation.context_per_round, output.stats.speculation.accepted_per_round, strict=True
        )
    ]
    return {
        "label": variant.label,
        "options": variant.options,
        "lossless": all(a.token_ids == b.token_ids for a, b in zip(outputs, baseline, strict=True)),
        "rounds": rounds,
        "mean_accepted": wrapped.last_stats.mean_accepted,
        "mean_drafted": wrapped.last_stats.num_draft_tokens / max(1, wrapped.last_stats.num_rounds),
        "tokens_per_s": wrapped.last_stats.generated_tokens / elapsed,
    }


def bucket_means(rounds: list[tuple[int, int]]) -> list[tuple[float, int] | None]:
    """(mean accepted, rounds) per context bucket, None where a bucket saw no round."""
    means = []
    for low, high in BUCKETS:
        inside = [accepted for context, accepted in rounds if context >= low and (high is None or context < high)]
        means.append((sum(inside) / len(inside), len(inside)) if inside else None)
    return means


def markdown(results: list[dict], command: str, machine: str, spec: dict) -> str:
    header = "| policy | lossless | all rounds | " + " | ".join(bucket_label(*b) for b in BUCKETS) + " | tok/s |"
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Settings: greedy, fp32 unless stated, k={spec['k']}, sparsity={spec['sparsity']}, "
        f"min_budget={spec['min_budget']}. Mean accepted drafts per verify round (bonus token not counted), "
        "rounds in parentheses.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for result in results:
        cells = ["-" if cell is None else f"{cell[0]:.2f} ({cell[1]})" for cell in bucket_means(result["rounds"])]
        lines.append(
            f"| {result['label']} | {'yes' if result['lossless'] else 'NO'} | {result['mean_accepted']:.2f} "
            f"({len(result['rounds'])}) | " + " | ".join(cells) + f" | {result['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str, bin_width: int = 256) -> None:
    """Mean accepted per round against context length, one line per policy."""
    curves = {result["label"]: context_bins(result["rounds"], bin_width) for result in results}
    plot_acceptance_vs_context(curves, Path(path), bin_width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=1536)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--sparsity", type=float, default=0.05)
    parser.add_argument("--min-budget", type=int, default=128)
    parser.add_argument(
        "--draft-step-budget", type=int, help="SpecConfig.draft_step_budget (default: the engine's; 0 compares the "
        "policies at their own budgets on a GPU, where the default lets a small batch draft from whole contexts)",
    )  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--policies", nargs="*", help="labels of the variants to run, or to tabulate (default: all)")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--json", help="write the raw per-round results here")
    parser.add_argument("--plot", help="write the acceptance-vs-context plot here (PNG)")
    parser.add_argument("--merge", nargs="*", help="tabulate earlier --json results instead of generating")
    parser.add_argument("--command", help="with --merge: the command line to record")
    parser.add_argument("--machine", help="with --merge: the machine to record")
    args = parser.parse_args()
    if args.merge:
        results = [result for path in args.merge for result in json.loads(Path(path).read_text())]
        results = [result for result in results if not args.policies or result["label"] in args.policies]
        spec = {"k": args.k, "sparsity": args.sparsity, "min_budget": args.min_budget}
        report(results, args.command, args.machine, spec, args.out, args.plot)
        return

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    prompts = reasoning_prompt_ids(tokenizer, args.prompts)
    spec = {"k": args.k, "sparsity": args.sparsity, "min_budget": args.min_budget, "max_batch_size": len(prompts)}
    spec["draft_step_budget"] = args.draft_step_budget
    baseline = list(
        sparsespec.wrap(model, draft=None, max_batch_size=len(prompts))
        .generate_batch(prompts, max_new_tokens=args.max_new_tokens, do_sample=False)
        .values()
    )
    variants = [v for v in default_variants() if not args.policies or v.label in args.policies]
    results = []
    for variant in variants:
        results.append(measure(model, prompts, args.max_new_tokens, baseline, variant, **spec))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rounds"}), flush=True)
        if args.json:
            with open(args.json, "w") as sink:
                json.dump(results, sink)
    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.processor() or 'x86_64'})"
    )
    command = "python -m torchspec.bench.acceptance " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if v is not None
        and k in ("prompts", "max_new_tokens", "k", "sparsity", "min_budget", "draft_step_budget", "dtype")
    )
    report(results, command, f"{device}, torch {torch.__version__}", spec, args.out, args.plot)


def report(results: list[dict], command: str, machine: str, spec: dict, out: str | None, plot_path: str | None) -> None:
    table = markdown(results, command, machine, spec)
    print(table)
    if out:
        with open(out, "w") as sink:
            sink.write(table)
    if plot_path:
        plot(results, plot_path)


if __name__ == "__main__":
    main()
