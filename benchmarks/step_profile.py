"""Where a speculative step's time goes: per-step wall times, the host's share of them by phase, and a
torch.profiler table with the GPU timeline.

    python -m benchmarks.step_profile --batch 256 --out profile.txt [--draft-chain off]
    python -m benchmarks.step_profile --model SmolLM2-135M-Instruct.Q4_1.gguf --warmup-steps 250

Without ``--model``, a randomly initialised model of SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads,
vocabulary 49,152) decodes from random prompts (no model file needed): random weights make the drafts mostly
rejected, which does not change a step's structure (a round always drafts k tokens). With ``--model``, that
model decodes W1's prompts (the packaged reasoning problems in its chat template), so acceptance and contexts
are the real ones. Sampling is W1's: temperature 0.65 and top-k 50 (transformers' default, which
``generate_batch`` applies; ``--top-k 0`` turns it off). Once every prompt is in, and ``--warmup-steps`` later
(graphs captured; contexts grow by ~7 tokens a round), the wall time of each step is taken (synchronised, so GPU
work counts) with the host's time in each phase of the engine loop (schedule, launch, read-back, commit); then
``--profile-steps`` run under ``torch.profiler``: host calls that block show as large self CPU times, idle GPU as
a self CUDA total well below the wall time, and the GPU timeline splits replays from kernels launched one by one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from torchspec import sparsespec
from torchspec.bench.records import add_engine_arguments, engine_options
from torchspec.models import load_model
from torchspec.request import SamplingParams
from torchspec.step import Phase
from torchspec.workloads import reasoning_prompt_ids

SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def random_model(device: torch.device, dtype: torch.dtype, **overrides: int) -> torch.nn.Module:
    """SmolLM2-135M's architecture with random weights (``overrides`` shrink it for tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**(SMOLLM2_SHAPE | overrides))).to(device=device, dtype=dtype).eval()


def random_prompts(vocab_size: int, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` uniformly random token ids (seeded)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size, (batch, prompt_len), generator=generator).tolist()


def profile_steps(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    warmup_steps: int,
    timed_steps: int,
    profile_steps: int,
    top_k: int = 0,
    **options,
) -> tuple[list[tuple[float, list[str]]], dict[str, float], str]:
    """Each timed step's (wall ms, phases it held), the host's ms per timed step in each phase of the engine's
    steps (``engine.HOST_PHASES``, as the engine times them), and the profiler's report of ``profile_steps`` more
    steps."""
    device = next(model.parameters()).device
    # The decoding steps this profiles are graph replays, and whole rounds unless the round length is asked to
    # adapt (it would mix in plain steps).
    options = {"adaptive_rounds": False} | options | {"cuda_graphs": True}
    wrapped = sparsespec.wrap(model, draft="pillar_recent", max_batch_size=len(prompts), **options)
    engine = wrapped.engine
    # A step emits at most k + 1 tokens per request (a whole round): enough for the steps that take the prompts
    # in (each takes up to max_step_tokens of them) and every step asked for.
    ramp_steps = -(-sum(map(len, prompts)) // engine.max_step_tokens) + 1
    new_tokens = (engine.config.k + 1) * (ramp_steps + warmup_steps + timed_steps + profile_steps)
    params = SamplingParams(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=0.65, top_k=top_k
    )
    steps = iter(engine.steps([engine.new_request(i, prompt, params) for i, prompt in enumerate(prompts)]))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    while any(item.phase is Phase.PREFILL for item in next(steps)[0].scheduled):
        pass  # the prompts are not all in yet: warm-up counts from the first step without a prompt chunk
    for _ in range(warmup_steps):
        next(steps)
    sync()
    timed, before = [], dict(engine.host_ms)
    for _ in range(timed_steps):
        start = time.perf_counter()
        plan, _ = next(steps)
        sync()
        timed.append((1e3 * (time.perf_counter() - start), sorted({item.phase.value for item in plan.scheduled})))
    host = {name: ms - before[name] for name, ms in engine.host_ms.items()}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(profile_steps):
            next(steps)
        sync()
        wall = 1e3 * (time.perf_counter() - start)
    averages = profiler.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    report = f"{profile_steps} steps, wall {wall:.1f} ms\n{table}"
    if device.type == "cuda":  # the GPU's own costliest ops, wherever the host launched them from
        report += "\n" + averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60)
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            profiler.export_chrome_trace(trace.name)
            events = json.loads(Path(trace.name).read_text())["traceEvents"]
        report += "\n" + format_segments(launch_segments(events))
    return timed, {name: ms / timed_steps for name, ms in host.items()}, report


def launch_segments(events: list[dict]) -> list[dict]:
    """The GPU timeline of a profiled run (chrome-trace events) as segments: each CUDA graph replay, and each
    run of kernels launched one by one between replays. Per segment: start and span (ms from the first
    kernel), the GPU's busy time in it, its kernel count and its three costliest kernels. A span well above
    its busy time is the GPU waiting for the host (between replays: the host preparing the next one)."""
    launches = {
        event["args"]["correlation"]: event["name"]
        for event in events
        if event.get("cat") == "cuda_runtime" and "correlation" in event.get("args", {})
    }
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    segments: list[dict] = []
    for kernel in kernels:
        correlation = kernel["args"].get("correlation")
        replay = correlation if launches.get(correlation) == "cudaGraphLaunch" else None
        if not segments or segments[-1]["replay"] != replay:
            segments.append({"replay": replay, "start": kernel["ts"], "end": kernel["ts"], "kernels": 0, "names": {}})
        segment = segments[-1]
        segment["end"] = max(segment["end"], kernel["ts"] + kernel["dur"])
        segment["kernels"] += 1
        segment["names"][kernel["name"]] = segment["names"].get(kernel["name"], 0.0) + kernel["dur"]
    origin = kernels[0]["ts"] if kernels else 0.0
    return [
        {
            "kind": "graph replay" if segment["replay"] is not None else "launched kernels",
            "start_ms": (segment["start"] - origin) / 1e3,
            "span_ms": (segment["end"] - segment["start"]) / 1e3,
            "busy_ms": sum(segment["names"].values()) / 1e3,
            "kernels": segment["kernels"],
            "top": sorted(segment["names"], key=segment["names"].get, reverse=True)[:3],
        }
        for segment in segments
    ]


def format_segments(segments: list[dict]) -> str:
    """A table of :func:`launch_segments`, one line per segment."""
    lines = ["GPU timeline: kind | start ms | span ms | busy ms | kernels | costliest kernels"]
    for segment in segments:
        top = ", ".join(name[:40] for name in segment["top"])
        lines.append(
            f"{segment['kind']} | {segment['start_ms']:.2f} | {segment['span_ms']:.2f} | {segment['busy_ms']:.2f} | "
            f"{segment['kernels']} | {top}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model file or directory: decode W1's prompts with it (default: random)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=200, help="random prompts' length (without --model)")
    parser.add_argument("--top-k", type=int, default=50, help="sampling's top-k (W1: transformers' default 50)")
    parser.add_argument("--warmup-steps", type=int, default=16)
    parser.add_argument("--timed-steps", type=int, default=6)
    parser.add_argument("--profile-steps", type=int, default=4)
    add_engine_arguments(parser)  # --draft-chain, --compile, ... (graphs are always on)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="write the step times and the profile table here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
        prompts = reasoning_prompt_ids(tokenizer, args.batch)
    else:
        model = random_model(device, dtype)
        prompts = random_prompts(model.config.vocab_size, args.batch, args.prompt_len)
    timed, host, table = profile_steps(
        model, prompts, args.warmup_steps, args.timed_steps, args.profile_steps, args.top_k, **engine_options(args)
    )
    report = "step wall times (ms, phases): " + ", ".join(f"{ms:.1f} {'+'.join(p)}" for ms, p in timed)
    report += "\nhost ms per step: " + ", ".join(f"{name} {ms:.2f}" for name, ms in host.items())
    print(report)
    if args.out:
        with open(args.out, "w") as sink:
            sink.write(f"{report}\n{table}\n")


if __name__ == "__main__":
    main()
