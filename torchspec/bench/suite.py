"""``torchspec bench``: one workload decoded by each named method in one process, and one report.

    torchspec bench --methods none,pillar_recent,hf --num-prompts 256 --output-len 8192 --out bench-w1
    torchspec bench --methods none,pillar_recent --sweep output-len=1024,2048,4096,8192 --out bench-lengths
    torchspec bench --methods pillar_recent,pillar_recent+k=4,pillar_recent+sparsity=0.1 --out bench-k
    torchspec bench --model-config qwen3-8b --max-batch-size 64 --context 8192 --methods none,pillar_recent

``--model-config`` measures what engine steps cost on a large model's shape with random weights (plain steps, and
rounds at two lengths whose difference is a draft forward's cost; no acceptance), see torchspec/bench/step_cost.py.

Every argument is checked before the model loads: a typo costs a second, not a model load and the runs before
the bad one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from torchspec.arguments import add_device_arguments, at_least, model_dtype
from torchspec.bench import step_cost
from torchspec.bench.methods import METHODS, method, methods_error
from torchspec.bench.records import environment
from torchspec.bench.report import write_report
from torchspec.bench.runs import MethodRun, Workload
from torchspec.config import DRAFT_POLICIES
from torchspec.models import DEFAULT_MODEL_NAME, load_model
from torchspec.parallel import launched_rank, launched_world_size, rank_device
from torchspec.workloads import read_prompts

#: What ``--sweep NAME=V1,V2,...`` can vary: output-len (new tokens a request), batch (requests at once, each
#: value's run decoding one full batch: that many prompts).
SWEEPS = ("output-len", "batch")
DEFAULT_METHODS = "none,pillar_recent,hf"


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str  # one of SWEEPS
    values: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.name}={','.join(map(str, self.values))}"


def method_names(text: str) -> list[str]:
    """An argparse type: a comma-separated list of known methods that can run here, each once."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    problem = "no method named" if not names else methods_error(names)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return names


def sweep(text: str) -> Sweep:
    """An argparse type: ``output-len=1024,2048`` or ``batch=32,64``, whole numbers >= 1."""
    name, equals, values = text.partition("=")
    if not equals or name not in SWEEPS:
        raise argparse.ArgumentTypeError(f"bad sweep {text!r}: use {' or '.join(f'{s}=N,N,...' for s in SWEEPS)}")
    try:
        numbers = tuple(int(value) for value in values.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad sweep {text!r}: its values are whole numbers, comma-separated") from None
    if min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"sweep value {min(numbers)} of {name} out of range: each must be >= 1")
    return Sweep(name, tuple(dict.fromkeys(numbers)))


def writable_dir(text: str) -> Path:
    """An argparse type: a folder that exists and can be written, or can be made where its nearest existing
    parent is a writable folder."""
    path = Path(text).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write the report into {text}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write the report into {text}: {existing} is not writable")
    return path


def prompts_file(text: str) -> str:
    """An argparse type: a prompts file that reads and holds at least one prompt."""
    try:
        found = read_prompts(text)
    except (OSError, ValueError, KeyError) as error:
        raise argparse.ArgumentTypeError(f"cannot read prompts from {text}: {error}") from None
    if not found:
        raise argparse.ArgumentTypeError(f"{text} holds no prompt")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``torchspec bench``."""
    parser.add_argument("--model", help=f"local HF directory or .gguf file (default: embedded {DEFAULT_MODEL_NAME})")
    parser.add_argument(
        "--prompts-file",
        type=prompts_file,
        help="a .jsonl file (field 'prompt') or a text file (one a line); "
        "default: the packaged AIME/OlympiadBench reasoning prompts",
    )
    parser.add_argument("--num-prompts", type=at_least(1), default=256, help="requests (cycles the file when larger)")
    parser.add_argument("--output-len", type=at_least(1), default=8192, help="new tokens a request (EOS held back)")
    parser.add_argument("--natural-lengths", action="store_true", help="stop at EOS (--output-len: the most)")
    parser.add_argument("--temperature", type=at_least(0.0, float), default=0.65, help="0 = greedy")
    parser.add_argument("--max-batch-size", type=at_least(1), default=256, help="requests decoded at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup-tokens", type=at_least(0), default=16, help="untimed tokens a prompt before each method's run"
    )
    parser.add_argument(
        "--methods",
        type=method_names,
        default=DEFAULT_METHODS,
        help=f"comma-separated, of: {', '.join(METHODS)}; torchspec's may carry settings for their run alone, "
        "e.g. pillar_recent+k=4+sparsity=0.1, query_sketch+sketch_shortlist=4, none+compile "
        f"(default: {DEFAULT_METHODS})",
    )
    parser.add_argument(
        "--sweep", type=sweep, help="run every method at each value: output-len=1024,2048,... or batch=32,64,..."
    )
    parser.add_argument(
        "--model-config",
        type=step_cost.config_name,
        help="measure engine step costs on a random-weight model of this shape instead of a workload "
        f"({', '.join(step_cost.MODEL_CONFIGS)})",
    )
    parser.add_argument(
        "--context", type=at_least(1), default=8192, help="prompt tokens a request, with --model-config (default 8192)"
    )
    parser.add_argument(
        "--tp",
        type=at_least(1),
        default=1,
        help="with --model-config, under torchrun with as many processes: shard the model over this many GPUs "
        "(tensor parallel), for a batch whose K/V one GPU cannot hold (default 1)",
    )
    parser.add_argument("--out", type=writable_dir, default="bench-report", help="the report's folder")
    parser.add_argument(
        "--threads", type=at_least(1), help="torch's CPU threads (default: torch's own; 1 suffers least on a busy CPU)"
    )
    add_device_arguments(parser)


def _workloads(args: argparse.Namespace, tokenizer: Any) -> Iterator[tuple[int | None, Workload]]:
    """(swept value or None, workload) of each point of the run."""
    settings = {
        "output_len": args.output_len,
        "natural_lengths": args.natural_lengths,
        "temperature": args.temperature,
        "max_batch_size": args.max_batch_size,
        "seed": args.seed,
        "warmup_tokens": args.warmup_tokens,
    }
    base = Workload.from_file(tokenizer, args.prompts_file, args.num_prompts, **settings)
    if args.sweep is None:
        yield None, base
    elif args.sweep.name == "output-len":
        yield from ((value, dataclasses.replace(base, output_len=value)) for value in args.sweep.values)
    else:
        for value in args.sweep.values:
            yield value, Workload.from_file(tokenizer, args.prompts_file, value, **settings | {"max_batch_size": value})


def _summary(run: MethodRun, sweep_name: str | None) -> str:
    point = "" if sweep_name is None else f" ({sweep_name}={run.sweep_value})"
    accepted = "" if run.mean_accepted is None else f", mean accepted {run.mean_accepted:.2f} of {run.k}"
    return f"{run.method}{point}: {run.tokens_per_s:.1f} tok/s, {run.time_per_output_token_ms:.1f} ms/token{accepted}"


def _text(value: Any) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


def _json(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float)) else _text(value)


#: Options of one mode only: a workload's, or the step costs' (``--model-config``).
WORKLOAD_OPTIONS = {"num_prompts", "output_len", "natural_lengths", "warmup_tokens", "prompts_file", "sweep"}
STEP_COST_OPTIONS = {"model_config", "context", "tp"}


def _command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every option of its mode spelled out."""
    words = ["torchspec", "bench"]
    other_mode = WORKLOAD_OPTIONS if args.model_config is not None else STEP_COST_OPTIONS
    for name, value in vars(args).items():
        if name != "command" and name not in other_mode and value is not None and value is not False:
            words += ["--" + name.replace("_", "-")] + ([] if value is True else [_text(value)])
    return shlex.join(words)


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (None: left as they are), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _busy_note() -> str | None:
    """A warning when other work already keeps the CPU busy: every method then runs slower and noisier, and
    more so with more threads (on a loaded 2-core machine, two threads ran a speculative step 8x slower than one)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < cores:
        return None
    return (
        f"note: load average {load:.1f} on {cores} cores before the run: other work competes for the CPU, so "
        "timings are slow and noisy (--threads 1 suffers least)"
    )


def _results(args: argparse.Namespace, dtype: str, workload: Workload) -> dict[str, Any]:
    """What the report holds besides the runs: the command, environment, workload and options."""
    return {
        "command": _command(args),
        "environment": environment(args.device, dtype),
        "workload": workload.summary(),
        "prompts": args.prompts_file or "the packaged reasoning prompts",
        "options": {name: _json(value) for name, value in vars(args).items() if name != "command"},
    }


def _run_methods(
    args: argparse.Namespace, model: Any, tokenizer: Any, dtype: str
) -> tuple[list[MethodRun], list[Path]]:
    """Every method at every point of the run, with a progress bar; the runs and the report's files. The report is
    written again after each run, so a run stopped part way (a time limit, an error) leaves the finished ones."""
    points = [(value, workload, name) for value, workload in _workloads(args, tokenizer) for name in args.methods]
    sweep_name = None if args.sweep is None else args.sweep.name
    runs: list[MethodRun] = []
    with tqdm(points, desc="bench", unit="run") as bar:
        for value, workload, name in bar:
            bar.set_postfix_str(name if value is None else f"{name}, {sweep_name}={value}")
            runs.append(dataclasses.replace(method(name)(model, tokenizer, workload), sweep_value=value))
            written = write_report(args.out, runs, _results(args, dtype, points[0][1]), sweep_name)
    return runs, written


def _step_cost_error(args: argparse.Namespace, dtype: torch.dtype) -> str | None:
    """Why ``--model-config`` cannot run as asked (None: it can), found before the model is built."""
    if args.model is not None:
        return "--model and --model-config exclude each other: one measures a model, the other a shape"
    if args.sweep is not None:
        return "--sweep does not apply to --model-config: run it once per batch size or context"
    peers = [name for name in args.methods if name in METHODS and name not in ("none", *DRAFT_POLICIES)]
    if peers:
        return f"--model-config measures torchspec's engine steps; drop the peers {', '.join(peers)} from --methods"
    set_apart = [name for name in args.methods if name not in METHODS]
    if set_apart:
        return f"--model-config measures each method at its defaults; drop the settings of {', '.join(set_apart)}"
    layout = step_cost.layout_error(args.model_config, args.tp)
    if layout:
        return layout
    if args.tp != launched_world_size():
        return (
            f"--tp {args.tp} needs as many processes, one a GPU, and this launch has {launched_world_size()}: run "
            f"torchrun --nproc-per-node {args.tp} -m torchspec bench ... --tp {args.tp}"
        )
    return step_cost.memory_error(
        args.model_config, args.max_batch_size, args.context, rank_device(args.device), dtype, args.tp
    )


def _step_costs(args: argparse.Namespace) -> int:
    """``--model-config``: each method's step costs on a random-weight model of that shape, reported into
    ``args.out``."""
    dtype = getattr(torch, model_dtype(args.dtype, args.device))
    problem = _step_cost_error(args, dtype)
    if problem:
        raise ValueError(problem)
    device = rank_device(args.device)
    model = step_cost.build_model(args.model_config, device, dtype)
    settings = dict(
        batch=args.max_batch_size,
        context=args.context,
        temperature=args.temperature,
        samples=step_cost.SAMPLES,
        seed=args.seed,
        tensor_parallel_size=args.tp,
    )
    results = {
        "command": _command(args),
        "environment": environment(device, dtype),
        "model_config": args.model_config,
        "shape": step_cost.MODEL_CONFIGS[args.model_config],
        "batch": args.max_batch_size,
        "context": args.context,
        "temperature": args.temperature,
        "tensor_parallel_size": args.tp,
    }
    reports = launched_rank() == 0  # every rank runs the steps; the first writes and prints
    costs = []
    with _threads(args.threads), tqdm(args.methods, desc="step cost", unit="method", disable=not reports) as bar:
        for method in bar:  # the report written again after each method: a stopped run keeps the finished ones
            bar.set_postfix_str(method)
            costs += step_cost.method_costs(model, method, **settings)
            if reports:
                written = step_cost.write_report(args.out, results, costs)
    if not reports:
        return 0
    for cost in costs:
        gpu = ""
        if cost.gpu_busy_ms is not None:
            gpu = f" (GPU busy {cost.gpu_busy_ms:.2f}, attention {cost.attention_ms:.2f} ms)"
        print(f"{step_cost.label(cost)}: {cost.wall_ms:.2f} ms{gpu}")
    print(f"report: {written[1]} ({len(written)} files in {args.out})")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run every method at every point, write the report into ``args.out``, print a summary."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("torchspec bench draws its plots with matplotlib: pip install matplotlib")
    note = _busy_note()
    if note:
        print(note, file=sys.stderr)
    if args.model_config is not None:
        return _step_costs(args)
    if args.tp > 1:
        raise ValueError("--tp shards a --model-config shape over GPUs; a workload's methods run on one")
    torch.manual_seed(args.seed)
    dtype = model_dtype(args.dtype, args.device)
    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    with _threads(args.threads):
        runs, written = _run_methods(args, model, tokenizer, dtype)
    sweep_name = None if args.sweep is None else args.sweep.name
    for run in runs:
        print(_summary(run, sweep_name))
    print(f"report: {written[1]} ({len(written)} files in {args.out})")
    return 0
