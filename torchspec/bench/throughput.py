"""End-to-end throughput of ``generate_batch`` on reasoning prompts, with and without speculation.

    python -m torchspec.bench.throughput --prompts 256 --max-new-tokens 4096 --temperature 0.65 \
        --drafts none pillar_recent --out throughput.jsonl

An ablation in one command: each ``--drafts`` entry may turn engine switches on or off for its run alone,
e.g. ``--drafts none none+compile pillar_recent-adaptive_rounds pillar_recent pillar_recent+compile``.

Every request generates exactly ``--max-new-tokens`` tokens (EOS is held back with ``min_new_tokens``, the
transformers way of ignoring it), so runs compare equal work; ``--natural-lengths`` stops at EOS instead. A
``--prompts`` count past the 705 packaged prompts cycles them (W3, issue 15: ``--prompts 1024 --drafts
pillar_recent pillar_recent+offload``). Before the timed run, each setting's engine
generates ``--warmup-tokens`` tokens for every prompt (untimed, recorded as ``warmup_s``): first-use costs
(Triton and FlexAttention compiles, the full batch's graph captures) would otherwise fall on whichever setting
runs first; captures for the smaller batches of the tail stay in the timed run, as in a real job. One JSON
line per draft setting: wall time, generated tokens per second, engine steps, mean accepted drafts per round,
peak device memory. ``--time-limit SECONDS`` stops a setting's timed run that is still going by then and records it
as it stood (``completed: false``: its rate, counters and time line), for a device lent by the minute.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from torchspec import sparsespec
from torchspec.bench.records import (
    KernelCompiles,
    add_engine_arguments,
    add_model_arguments,
    append_record,
    engine_options,
    environment,
    parse_setting,
)
from torchspec.causal_lm import RequestOutput
from torchspec.engine import HOST_PHASES, Engine
from torchspec.kv_cache import reclaim_device_memory
from torchspec.kv_offload import OffloadStats
from torchspec.models import load_model
from torchspec.request import Request
from torchspec.step import StepPlan
from torchspec.workloads import reasoning_prompt_ids


def _quantiles(values: Sequence[float], levels: Sequence[float]) -> list[float]:
    """Nearest-rank quantiles (1.0: the maximum)."""
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(level * len(ordered)))] for level in levels]


#: Width of the context-length bins that acceptance is reported in.
CONTEXT_BIN_TOKENS = 512


def context_bins(rounds: Iterable[tuple[int, int]], bin_tokens: int = CONTEXT_BIN_TOKENS) -> list[dict]:
    """Mean accepted drafts of the (context length, accepted) ``rounds`` in context bins of ``bin_tokens``, the
    bins that saw a round in order: whether drafts stay good as contexts grow."""
    bins: dict[int, list[int]] = {}
    for context, accepted in rounds:
        bins.setdefault(context // bin_tokens, []).append(accepted)
    return [
        {"context_from": index * bin_tokens, "rounds": len(values), "mean_accepted": statistics.fmean(values)}
        for index, values in sorted(bins.items())
    ]


def _rounds(outputs: Sequence[RequestOutput]) -> Iterator[tuple[int, int]]:
    """(context length, accepted drafts) of every verify round of ``outputs``."""
    for output in outputs:
        speculation = output.stats.speculation
        yield from zip(speculation.context_per_round, speculation.accepted_per_round, strict=True)


def time_per_output_token_ms(requests: Iterable[tuple[float, int]]) -> float:
    """A request's latency (arrival to finish) over its output tokens, in ms, averaged over the (latency,
    output tokens) of ``requests``: what a user waits per token, where tokens/s counts the whole batch."""
    return 1e3 * statistics.fmean(latency / max(tokens, 1) for latency, tokens in requests)


#: A run's trace (``StepTimeline``), per step applied: seconds into the run, requests in the step, K/V tokens held
#: in the device pool and in the host tier, tokens moved to the host and back so far, and the host's milliseconds
#: so far in each phase of the engine's steps (``HOST_TRACE_FIELDS``: where a host-paced step's time goes).
HOST_TRACE_FIELDS = tuple(f"host_{phase.replace('-', '_')}_ms" for phase in HOST_PHASES)
TRACE_FIELDS = (
    "seconds", "requests", "pool_tokens", "host_tokens", "offloaded_tokens", "restored_tokens", *HOST_TRACE_FIELDS
)  # fmt: skip
TRACE_POINTS = 400  # steps a record's trace keeps at most


def trace_steps(steps: int, points: int = TRACE_POINTS) -> list[int]:
    """The steps a trace of ``steps`` keeps (``StepTimeline.sampled_trace``): evenly spaced from the first, at most
    ``points`` of them, and the last."""
    stride = max(1, -(-steps // points))
    kept = list(range(0, steps, stride))
    if kept and kept[-1] != steps - 1:
        kept.append(steps - 1)
    return kept


#: A record's fields read from each request's output (None when a run stopped at its time limit).
REQUEST_FIELDS = (
    "time_per_output_token_ms",
    "acceptance_by_context",
    "latency_s_p50_p90_max",
    "request_accepted_p10_p50_p90",
    "slowest_requests",
)


class TimeLimitReached(Exception):
    """A timed run stopped at its time limit (raised by the timeline's observer, inside the engine's loop, which
    ends its running requests keeping their tokens)."""


class StepTimeline:
    """Each engine step of a run: how many requests it held, its wall time, and its rounds' draft count (0: a
    plain step); the most KV pool slots held after a step; and a trace over the run's time of the requests in each
    step, the K/V tokens held on the device and in the host tier (``offload``), the tokens moved out and back so far
    and the host's time so far in each phase of the steps: where a run's batch shrinks or waits on memory, and where
    the host sets its pace. Attached to an engine (one of its ``observers``), it
    records every step the engine applies from then on. With ``time_limit_s``, it stops the run once that much
    time has passed (``TimeLimitReached``), keeping every request it saw for the record of what was made."""

    def __init__(self, engine: Engine, time_limit_s: float | None = None) -> None:
        self.steps: list[tuple[int, float, int]] = []
        self.peak_pool_tokens = 0
        self.trace: list[tuple] = []  # see ``TRACE_FIELDS``
        self._engine = engine
        self._last = 0.0  # when the last step recorded was applied
        self.time_limit_s = time_limit_s
        self.requests: dict[int, Request] = {}  # by id(): every request a step held (with a time limit only)
        engine.observers.append(self.record)

    def record(self, plan: StepPlan, finished: list[Request]) -> None:
        """One applied step: its wall time since the last one (the first: since its run began), and the trace."""
        now, engine = time.perf_counter(), self._engine
        since = max(self._last, engine.run_start)
        self.steps.append((len(plan.scheduled), now - since, plan.round_length))
        pool_tokens = engine.pool.num_slots - engine.pool.allocator.num_free
        self.peak_pool_tokens = max(self.peak_pool_tokens, pool_tokens)
        moved = engine.runner.host.stats if engine.runner.host is not None else OffloadStats()
        host_tokens = moved.offloaded_tokens - moved.restored_tokens
        self.trace.append(
            (now - engine.run_start, len(plan.scheduled), pool_tokens, host_tokens, moved.offloaded_tokens,
             moved.restored_tokens, *(engine.host_ms[phase] for phase in HOST_PHASES))
        )  # fmt: skip
        self._last = now
        if self.time_limit_s is not None:
            self.requests.update((id(item.request), item.request) for item in plan.scheduled)
            if now - engine.run_start > self.time_limit_s:
                raise TimeLimitReached

    def sampled_trace(self, points: int = TRACE_POINTS) -> dict[str, list]:
        """The trace at ``points`` steps at most, evenly spaced from the first (a W1 run has ~8K steps), and the
        last, as one list per field (``TRACE_FIELDS``)."""
        kept = [self.trace[step] for step in trace_steps(len(self.trace), points)]
        return {name: [row[i] for row in kept] for i, name in enumerate(TRACE_FIELDS)}

    def copy_overlap(self) -> dict | None:
        """Whether the host tier's copies slow the steps they overlap: the median wall time of steps that issued
        copies and of those that did not, among steps of the kind most copying steps were (the same requests and
        round length, so the two hold the same work); None when no step copied, or none of that kind did not."""
        moved = [row[4] + row[5] for row in self.trace]
        copying = {i for i in range(len(moved)) if moved[i] != (moved[i - 1] if i else 0)}
        if not copying:
            return None
        kind = statistics.mode((self.steps[i][0], self.steps[i][2]) for i in sorted(copying))
        same = [i for i, step in enumerate(self.steps) if (step[0], step[2]) == kind]
        with_copies = [self.steps[i][1] for i in same if i in copying]
        without = [self.steps[i][1] for i in same if i not in copying]
        if not without:
            return None
        return {
            "requests": kind[0],
            "round_length": kind[1],
            "steps_with_copies": len(with_copies),
            "steps_without": len(without),
            "ms_with_copies": 1e3 * statistics.median(with_copies),
            "ms_without": 1e3 * statistics.median(without),
        }

    def by_batch(self) -> list[dict]:
        """Steps grouped by batch size (powers of two: 256, 128-255, 64-127, ...): where a run's time went, how
        many of those steps ran rounds (with drafts) and of what mean length, and the host's milliseconds a step
        in each phase (``HOST_PHASES``): a step whose host waits on the read-back is paced by the GPU, one whose
        schedule, launch and commit fill its time by the host."""
        phases, first = len(HOST_PHASES), TRACE_FIELDS.index(HOST_TRACE_FIELDS[0])
        # The host's ms so far in each phase, after each step (the trace's ``HOST_TRACE_FIELDS``).
        cumulative = [row[first : first + phases] for row in self.trace]
        host = [
            [now - then for now, then in zip(*pair, strict=True)]
            for pair in zip(cumulative, [(0.0,) * phases, *cumulative[:-1]], strict=True)
        ]
        groups: dict[int, list[tuple[tuple[int, float, int], list[float]]]] = {}
        for step, host_ms in zip(self.steps, host, strict=True):
            groups.setdefault(1 << (step[0].bit_length() - 1), []).append((step, host_ms))
        return [
            {
                "batch_from": low,
                "steps": len(members),
                "seconds": sum(seconds for (_, seconds, _), _ in members),
                "round_steps": sum(length > 0 for (_, _, length), _ in members),
                "mean_round_length": statistics.fmean([n for (_, _, n), _ in members if n] or [0]),
                "host_ms_per_step": {
                    phase: statistics.fmean(ms[j] for _, ms in members) for j, phase in enumerate(HOST_PHASES)
                },
            }
            for low, members in sorted(groups.items(), reverse=True)
        ]


def device_memory_gib(device: torch.device) -> dict[str, float] | None:
    """The device's memory as an engine's automatic pool finds it (after a gc and emptying PyTorch's cache): free
    by the driver's count, held by live tensors, and cached by the allocator all the same (None on a CPU). Beside
    each run's pool size it shows what an earlier engine in the process left behind."""
    if device.type != "cuda":
        return None
    free, total = reclaim_device_memory(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    sizes = {"free": free, "total": total, "allocated": allocated, "cached": reserved - allocated}
    return {name: value / 2**30 for name, value in sizes.items()}


#: The CUDA caching allocator's counters a record keeps (their growth over the timed run): each ``cudaMalloc``
#: and ``cudaFree`` it made and each time a ``cudaMalloc`` failed and it freed its cache to retry (which waits for
#: the device): a step that calls the driver for memory can stall the host behind the GPU.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counters(device: torch.device) -> dict[str, int] | None:
    """``ALLOCATOR_COUNTERS`` as the allocator has them now (None on a CPU)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: stats.get(name, 0) for name in ALLOCATOR_COUNTERS}


def allocator_calls_since(before: dict[str, int] | None, device: torch.device) -> dict[str, int] | None:
    """How much each of ``ALLOCATOR_COUNTERS`` grew since ``before`` (``allocator_counters``; None on a CPU)."""
    after = allocator_counters(device)
    return None if before is None or after is None else {name: after[name] - before[name] for name in after}


def _request_fields(outputs: Sequence[RequestOutput] | None) -> dict:
    """A record's fields read from each request's output; None for a run stopped at its time limit (its requests
    never returned)."""
    if outputs is None:
        return dict.fromkeys(REQUEST_FIELDS)
    return {
        "time_per_output_token_ms": time_per_output_token_ms((o.stats.latency_s, len(o.token_ids)) for o in outputs),
        "acceptance_by_context": context_bins(_rounds(outputs)),
        # The batch's tail: a run lasts as long as its slowest request; per-request spread of both.
        "latency_s_p50_p90_max": _quantiles([o.stats.latency_s for o in outputs], (0.5, 0.9, 1.0)),
        "request_accepted_p10_p50_p90": _quantiles([o.stats.mean_accepted for o in outputs], (0.1, 0.5, 0.9)),
        # The requests that set the run's length: a round costs about the same for one request as for many.
        "slowest_requests": [_request_summary(o) for o in sorted(outputs, key=lambda o: o.stats.latency_s)[-2:]],
    }


def _request_summary(output: RequestOutput) -> dict[str, float]:
    stats = output.stats
    return {"rounds": stats.speculation.num_rounds, "mean_accepted": stats.mean_accepted, "latency_s": stats.latency_s}


def measure(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    draft: str | None,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    warmup_tokens: int = 0,
    natural_lengths: bool = False,
    max_batch_size: int | None = None,
    time_limit_s: float | None = None,
    **options,
) -> dict:
    """One ``generate_batch`` over ``prompts`` with ``draft``, at most ``max_batch_size`` requests at once (None:
    all of them), after an untimed one of ``warmup_tokens`` tokens each when asked; its throughput record. A run
    still going after ``time_limit_s`` stops there and is recorded as it stood (``completed`` false: its rate,
    counters and time line, not the fields read from each request's output)."""
    device = next(model.parameters()).device
    wrapped = sparsespec.wrap(model, draft=draft, max_batch_size=max_batch_size or len(prompts), **options)
    memory_before = device_memory_gib(device)  # what the engine, built at the first call, sizes its pool from

    def generate(new_tokens: int) -> list[RequestOutput]:
        return list(
            wrapped.generate_batch(
                [list(p) for p in prompts],
                max_new_tokens=new_tokens,
                min_new_tokens=0 if natural_lengths else new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else 1.0,
            ).values()
        )

    warmup_s = 0.0
    if warmup_tokens:
        warmup_start = time.perf_counter()
        generate(warmup_tokens)
        warmup_s = time.perf_counter() - warmup_start
    timeline = StepTimeline(wrapped.engine, time_limit_s)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    allocator_before = allocator_counters(device)
    torch.manual_seed(seed)  # after the warm-up: the timed run samples the same with or without one
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs: list[RequestOutput] | None = None
    # Stopped at the time limit, its requests keep what they made, counted below from those the timeline saw.
    with KernelCompiles() as compiles, contextlib.suppress(TimeLimitReached):
        outputs = generate(max_new_tokens)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if outputs is None:
        stats = wrapped.engine.stats_for(list(timeline.requests.values()))
        generated = stats.generated_tokens
    else:
        stats = wrapped.last_stats
        generated = sum(len(o.token_ids) for o in outputs)
    graphs = wrapped.engine.runner.graphs
    allocator_calls = allocator_calls_since(allocator_before, device)
    return {
        "draft": draft,
        "requests": len(prompts),
        "max_batch_size": wrapped.engine.config.max_batch_size,
        "k": wrapped.engine.config.k if draft else None,
        "sparsity": wrapped.engine.config.sparsity if draft else None,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "natural_lengths": natural_lengths,  # EOS respected (else held back to max_new_tokens)
        "warmup_tokens": warmup_tokens,
        "warmup_s": warmup_s,
        "completed": outputs is not None,  # false: stopped at time_limit_s
        "time_limit_s": time_limit_s,
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "steps": stats.steps,
        "ms_per_step": 1e3 * seconds / max(stats.steps, 1),
        "cpu_ms_per_step": 1e3 * cpu_seconds / max(stats.steps, 1),  # host time (all threads) per engine step
        # The host's ms per engine step in each phase (schedule, launch, read-back: the wait for the device, commit).
        "host_ms_per_step": {name: ms / max(stats.steps, 1) for name, ms in stats.host_ms.items()},
        "options": {name: str(value) for name, value in options.items()},
        "mean_accepted": stats.mean_accepted,
        "accepted_histogram": list(stats.accepted_histogram),  # rounds that accepted 0, 1, ..., k drafts
        **_request_fields(outputs),
        # Where the time went: the first steps (prompts, graph captures, compiles), then steps by batch size.
        "first_20_steps_s": sum(seconds for _, seconds, _ in timeline.steps[:20]),
        "steps_by_batch": timeline.by_batch(),
        # Requests, device and host K/V tokens and tokens moved over the run (``TRACE_FIELDS``), for plot_timeline.py.
        "timeline": timeline.sampled_trace(),
        # Steps that issued host-tier copies against like steps that did not (median ms; None without copies).
        "copy_overlap": timeline.copy_overlap(),
        # Graph captures of the whole call, warm-up included (a draining batch captures at new buckets).
        "graph_captures": None if graphs is None else graphs.captures.count,
        "graph_capture_s": None if graphs is None else graphs.captures.seconds,
        # What each capture was and why it was made: {kind: why: [captures, seconds]}, then every one in order.
        "graph_captures_by_reason": None if graphs is None else graphs.captures.by_reason(),
        "graph_capture_events": None if graphs is None else graphs.captures.events,
        # Triton kernels compiled during the timed call: (seconds into it, seconds taken, which variant).
        "kernel_compiles": compiles.events,
        "kernel_compile_s": sum(taken for _, taken, _ in compiles.events),
        "kv_capacity_tokens": wrapped.engine.kv_capacity_tokens,
        "peak_pool_tokens": timeline.peak_pool_tokens,  # most KV slots held after a step of the timed run
        # The KV host tier (offload): K/V rows moved out and back, peak use of both tiers, host time copying.
        "offload": None if stats.offload is None else dataclasses.asdict(stats.offload),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "memory_before_gib": memory_before,
        # The caching allocator's driver calls during the timed run (``ALLOCATOR_COUNTERS``; None on a CPU).
        "allocator_calls": allocator_calls,
        **environment(device, next(model.parameters()).dtype),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument(
        "--natural-lengths", action="store_true", help="stop at EOS (default: EOS held back to --max-new-tokens)"
    )
    parser.add_argument("--temperature", type=float, default=0.65)
    parser.add_argument(
        "--warmup-tokens", type=int, default=16, help="untimed tokens per prompt before each timed run (0: none)"
    )
    parser.add_argument(
        "--drafts",
        nargs="+",
        default=["none", "pillar_recent"],
        help="runs, each a draft policy or none, optionally with +switch / -switch (e.g. pillar_recent+compile)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        help="seconds a timed run may take: one still going then stops and is recorded as it stood (completed: false)",
    )
    add_model_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--out", help="append one JSON line per draft setting")
    args = parser.parse_args(argv)
    try:
        settings = [(text, *parse_setting(text)) for text in args.drafts]  # all checked before loading
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    prompts = reasoning_prompt_ids(tokenizer, args.prompts)
    for text, draft, overrides in settings:
        options = engine_options(args) | overrides
        record = measure(
            model,
            prompts,
            draft,
            args.max_new_tokens,
            args.temperature,
            warmup_tokens=args.warmup_tokens,
            natural_lengths=args.natural_lengths,
            time_limit_s=args.time_limit,
            **options,
        )
        record["setting"] = text
        print(
            f"{text}: {record['generated_tokens']} tokens in {record['seconds']:.1f} s, "
            f"{record['tokens_per_s']:.1f} tok/s, {record['steps']} steps ({record['ms_per_step']:.1f} ms, "
            f"host {record['cpu_ms_per_step']:.1f} ms each), mean accepted {record['mean_accepted']:.2f}, "
            f"{record['kernel_compile_s']:.1f} s compiling kernels mid-run"  # a cold kernel cache's: not the method's
            + ("" if record["completed"] else f" (stopped at the {args.time_limit:g} s time limit)")
        )
        append_record(args.out, record)


if __name__ == "__main__":
    main()
