"""One decode step of a full batch at a long context, against the HBM roofline.

    python -m benchmarks.decode_step --batch 256 --context 4096 --out step.jsonl

Prefills ``--batch`` requests of ``--context`` prompt tokens (token ids drawn at random: the attention
and matmul work of a step does not depend on the text), then times ``--steps`` plain decoding steps
(``draft=None``, greedy) one by one: wall time per step (the step ends when its tokens reach the host)
and the host CPU time it took. Roofline: the bytes a step must read (every weight once, and each request's
K/V) over the H200's 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from torchspec import sparsespec
from torchspec.bench.gpu_time import kernel_kind
from torchspec.bench.records import (
    add_engine_arguments,
    add_model_arguments,
    append_record,
    engine_options,
    environment,
)
from torchspec.cuda_graphs import StepGraphs
from torchspec.kv_cache import bytes_per_token
from torchspec.models import load_model
from torchspec.request import SamplingParams
from torchspec.step import Phase

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e


def measure(
    model: torch.nn.Module, batch: int, context: int, steps: int, seed: int = 0, profile: str | None = None, **options
) -> dict:
    """Time ``steps`` decode steps of ``batch`` requests whose contexts start at ``context`` tokens (and write a
    per-kernel profile of the step's graph to ``profile``).

    Prefill chunks hold up to 64K tokens, so every request is decoding after a few steps (requests prefilled
    first decode a few tokens meanwhile); only steps in which all ``batch`` requests decode are timed."""
    wrapped = sparsespec.wrap(model, draft=None, max_batch_size=batch, max_step_tokens=1 << 16, **options)
    engine = wrapped.engine
    vocab = engine.vocab_size
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=steps + 64, min_new_tokens=steps + 64)
    requests = [
        engine.new_request(i, torch.randint(vocab, (context,), generator=generator).tolist(), params)
        for i in range(batch)
    ]
    timings: list[tuple[float, float, int]] = []  # (wall s, host s, summed context) per decode step
    prefill_tokens, prefill_s, warm_up = 0, 0.0, 2  # steps carrying prompt chunks, after the first two (JIT)
    last_wall, last_cpu = time.perf_counter(), time.process_time()
    progress = tqdm(total=steps + 2, desc="decode steps", unit="step")
    for plan, _ in engine.steps(requests):
        wall, cpu = time.perf_counter(), time.process_time()
        chunk_tokens = sum(item.num_query_tokens for item in plan.scheduled if item.phase is Phase.PREFILL)
        if chunk_tokens:  # next to at most ``batch`` one-token decodes: the step is the chunk's cost
            warm_up -= 1
            if warm_up < 0:
                prefill_tokens += chunk_tokens
                prefill_s += wall - last_wall
        decode = all(item.phase is Phase.VERIFY and item.num_query_tokens == 1 for item in plan.scheduled)
        if decode and len(plan.scheduled) == batch:
            timings.append((wall - last_wall, cpu - last_cpu, sum(i.first_position + 1 for i in plan.scheduled)))
            progress.update()
            if len(timings) == steps + 2:
                break
        last_wall, last_cpu = wall, cpu
    progress.close()
    timings = timings[2:]  # the first decode steps capture graphs / compile
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = statistics.median(t[2] for t in timings) * bytes_per_token(wrapped.layers, engine.dtype)
    roofline_s = (weight_bytes + kv_bytes) / PEAK_BYTES_PER_S
    step_s = statistics.median(t[0] for t in timings)
    graphs = engine.runner.graphs
    replay_ms = graphs.replay_ms() if graphs is not None and graphs.capture else None
    if profile and replay_ms is not None:
        with open(profile, "w") as f:
            f.write(profile_replay(graphs) + "\n")
    return {
        "batch": batch,
        "context": context,
        "steps_timed": len(timings),
        "step_ms": 1e3 * step_s,
        "host_ms": 1e3 * statistics.median(t[1] for t in timings),
        "roofline_ms": 1e3 * roofline_s,
        "x_roofline": step_s / roofline_s,
        "replay_ms": replay_ms,  # the step's forward alone on the GPU (graphs only)
        "replay_x_roofline": replay_ms / 1e3 / roofline_s if replay_ms is not None else None,
        "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s else None,
        "weight_gb": weight_bytes / 1e9,
        "kv_gb": kv_bytes / 1e9,
        "tokens_per_s": batch / step_s,
        "options": {name: str(value) for name, value in options.items()},
        **environment(engine.device, engine.dtype),
    }


def profile_replay(graphs: StepGraphs, repeats: int = 10) -> str:
    """torch.profiler over ``repeats`` back-to-back replays of the step's graph: GPU time per kernel kind and
    the kernels that take the most, per replay (where the gap to the roofline goes)."""
    from torch.profiler import ProfilerActivity, profile

    graphs.replay_latest(2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.replay_latest(repeats)
        torch.cuda.synchronize()
    kernels = [(e.key, e.device_time_total / repeats / 1e3, e.count / repeats) for e in prof.key_averages()]
    kernels = sorted((k for k in kernels if k[1] > 0), key=lambda k: -k[1])
    kinds: dict[str, list[float]] = {}
    for name, ms, count in kernels:
        sums = kinds.setdefault(kernel_kind(name), [0.0, 0.0])
        sums[0] += ms
        sums[1] += count
    by_kind = sorted(((kind, ms, count) for kind, (ms, count) in kinds.items()), key=lambda k: -k[1])
    total = f"GPU time per replay: {sum(k[1] for k in kernels):.3f} ms"
    return "\n\n".join([total, _table("kind", by_kind), _table("kernel", kernels[:25])])


def _table(label: str, rows: list[tuple[str, float, float]]) -> str:
    lines = [f"| {label} | ms | launches |", "|---|---|---|"]
    return "\n".join(lines + [f"| {name[:90]} | {ms:.3f} | {count:.0f} |" for name, ms, count in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    add_model_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--out", help="append one JSON line")
    parser.add_argument("--profile", metavar="PATH", help="write a per-kernel profile of the step's graph (graphs)")
    args = parser.parse_args(argv)
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    record = measure(model, args.batch, args.context, args.steps, profile=args.profile, **engine_options(args))
    print(
        f"batch {args.batch} x context {args.context}: {record['step_ms']:.2f} ms per decode step "
        f"(host {record['host_ms']:.2f} ms), roofline {record['roofline_ms']:.2f} ms "
        f"({record['weight_gb']:.2f} GB weights + {record['kv_gb']:.2f} GB K/V): {record['x_roofline']:.2f}x"
    )
    if record["replay_ms"] is not None:
        print(f"graph replay alone: {record['replay_ms']:.2f} ms ({record['replay_x_roofline']:.2f}x the roofline)")
    if record["prefill_tokens_per_s"] is not None:
        print(f"prefill: {record['prefill_tokens_per_s']:,.0f} tokens/s")
    append_record(args.out, record)


if __name__ == "__main__":
    main()
