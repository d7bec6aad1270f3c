"""What an engine step costs on a large model's shape, without its weights (``torchspec bench --model-config``).

    torchspec bench --model-config qwen3-8b --max-batch-size 64 --context 8192 --methods none,pillar_recent

The model is built from a published architecture with random weights: a step's cost depends on the shapes, not
on the values. Every request holds ``--context`` random prompt tokens; once all of them decode together, steps
are timed (wall and host CPU time, median) and, on a GPU, profiled (busy time and the attention's share), every
engine option at its default:

- method ``none``: a plain decoding step (one token a request);
- a draft policy: a whole round (k drafts, each fed the last on the device, and their verify, in one step),
  at the default k and at ``SHORT_K``. Their difference is what each draft forward adds; the rest of a round is
  its verify and fixed work (acceptance, the policy's learning, the host's share).

Acceptance is not measured: random weights draft nothing a trained model would. The report gives instead what
a round must accept to pay: a round emits its accepted drafts plus one token, a plain step one token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchspec import sparsespec
from torchspec.bench import gpu_time
from torchspec.bench.report import new_figure, save_plot
from torchspec.config import SpecConfig
from torchspec.engine import Engine
from torchspec.kv_cache import reclaim_device_memory
from torchspec.parallel.layout import LayoutError, kv_heads_per_rank
from torchspec.request import Request, SamplingParams
from torchspec.step import Phase, StepPlan

_QWEN3 = {"vocab_size": 151936, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960}
#: The shapes ``--model-config`` knows (Qwen3's published configurations; the weights are random).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": _QWEN3
    | {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16}
    | {"tie_word_embeddings": True},
    "qwen3-8b": _QWEN3
    | {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32},
    "qwen3-14b": _QWEN3
    | {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40},
}
SHORT_K = 4  # the other round length measured: the difference of two rounds is what a draft forward adds
PREFILL_STEP_TOKENS = 16384  # prompt tokens a step: few steps until the whole batch decodes
SAMPLES = 8  # steps of each kind timed, and as many profiled on a GPU
WARMUP_STEPS = 2  # steps of each kind left out first (graph captures, kernel compiles)
PLOT = "step_cost.png"
TOP_K = 50  # sampled requests keep the 50 likeliest tokens, as transformers' generate does by default


def config_name(text: str) -> str:
    """An argparse type: a model configuration ``--model-config`` knows."""
    if text not in MODEL_CONFIGS:
        raise argparse.ArgumentTypeError(f"unknown model config {text!r}; choose from {', '.join(MODEL_CONFIGS)}")
    return text


def model_config(name: str) -> Any:
    """The transformers config of shape ``name`` (full attention in every layer, no EOS)."""
    from transformers import Qwen3Config

    return Qwen3Config(**MODEL_CONFIGS[name], use_sliding_window=False, eos_token_id=None)


def weight_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes of the model's weights, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize


def memory_error(
    name: str, batch: int, tokens: int, device: torch.device, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> str | None:
    """Why ``batch`` requests of up to ``tokens`` tokens each cannot sit in ``device``'s free memory beside
    model ``name``'s weights, with this device's share of the KV heads over ``tensor_parallel_size`` ranks (the
    model is built whole before it is sharded); None: they can (a CPU is not checked)."""
    if device.type != "cuda":
        return None
    config = model_config(name)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    share = kv_heads_per_rank(heads, kv_heads, tensor_parallel_size, name) / kv_heads  # of the K/V this GPU holds
    kv = int(batch * tokens * kv_bytes_per_token(config, dtype) * share)
    weights = weight_bytes(config, dtype)
    free = torch.cuda.mem_get_info(device)[0]
    if weights + kv <= free:
        return None
    sharded = f" (its share over {tensor_parallel_size} GPUs)" if tensor_parallel_size > 1 else ""
    return (
        f"{name} at {batch} requests x {tokens} tokens needs {weights / 1e9:.1f} GB of weights and {kv / 1e9:.1f} GB "
        f"of K/V{sharded}; {device} has {free / 1e9:.1f} GB free: lower --max-batch-size or --context, or shard "
        "it over more GPUs (--tp)"
    )


def layout_error(name: str, tensor_parallel_size: int) -> str | None:
    """Why model ``name``'s heads cannot be sharded over ``tensor_parallel_size`` ranks (None: they can)."""
    config = model_config(name)
    try:
        kv_heads_per_rank(config.num_attention_heads, config.num_key_value_heads, tensor_parallel_size, name)
    except LayoutError as error:
        return str(error)
    return None


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Model ``name`` with random weights (seeded), built on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(model_config(name), dtype=dtype).eval()


def step_kind(plan: StepPlan, batch: int) -> str | None:
    """``plain`` or ``round`` when all ``batch`` requests take part in the step that way (None: any other step,
    e.g. one that still prefills)."""
    items = plan.scheduled
    if len(items) != batch:
        return None
    if all(item.phase is Phase.VERIFY and item.num_query_tokens == 1 for item in items):
        return "plain"
    if all(item.phase is Phase.DRAFT and item.verifies for item in items):
        return "round"
    return None


@dataclass
class StepCost:
    """One kind of step of one method: medians over its timed steps; GPU figures are means over profiled ones."""

    method: str  # none or a draft policy
    step: str  # plain or round
    k: int  # drafts a round
    steps_timed: int
    wall_ms: float
    host_ms: float  # host CPU time of the step (all threads)
    gpu_busy_ms: float | None = None  # time the GPU ran at least one kernel (CUDA only)
    attention_ms: float | None = None  # of which attention kernels


class _Steps:
    """An engine's steps over its requests, taken one at a time: each one's kind, wall and host CPU time."""

    def __init__(self, engine: Engine, requests: Sequence[Request], batch: int) -> None:
        self._iterator = engine.steps(requests)
        self.batch = batch

    def take(self) -> tuple[str | None, float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        plan, _ = next(self._iterator, (None, None))
        if plan is None:
            raise RuntimeError("the requests finished before enough steps of the whole batch were measured")
        return step_kind(plan, self.batch), time.perf_counter() - wall, time.process_time() - cpu

    def close(self) -> None:
        self._iterator.close()


def _timed(steps: _Steps, kind: str, samples: int) -> list[tuple[float, float]]:
    """(wall s, host s) of ``samples`` steps of ``kind``, after ``WARMUP_STEPS`` of them left out."""
    timings: list[tuple[float, float]] = []
    seen = 0
    while len(timings) < samples:
        step, wall, cpu = steps.take()
        if step == kind:
            seen += 1
            if seen > WARMUP_STEPS:
                timings.append((wall, cpu))
    return timings


def _profiled(steps: _Steps, kind: str, samples: int) -> tuple[float, float]:
    """Mean GPU busy and attention ms per step, from a ``torch.profiler`` window of ``samples`` steps all of
    ``kind``. The GPU is idle as the window opens and closes, so it holds exactly ``samples`` steps' kernels
    (with steps launched ahead, those of the steps after the ones read back: the same kind in a steady run)."""
    from torch.profiler import ProfilerActivity, profile

    while True:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            window = {steps.take()[0] for _ in range(samples)}
            torch.cuda.synchronize()
        if window == {kind}:
            kernels = gpu_time.kernels(prof)
            return gpu_time.busy_us(kernels) / 1e3 / samples, gpu_time.attention_us(kernels) / 1e3 / samples


def measure(
    model: torch.nn.Module,
    method: str,
    batch: int,
    context: int,
    temperature: float,
    samples: int,
    k: int,
    seed: int = 0,
    tensor_parallel_size: int = 1,
) -> StepCost:
    """Cost of a step when ``batch`` requests of ``context`` random prompt tokens decode together with
    ``method`` (``none``: plain steps; a draft policy: rounds of ``k`` drafts): ``samples`` timed steps, and as
    many profiled on a GPU. With ``tensor_parallel_size`` > 1 every rank of the group (torchrun) runs the same
    steps on its shard of the model; each times its own."""
    device = next(model.parameters()).device
    if device.type == "cuda":  # the last engine's pool must be gone before this one is allocated
        reclaim_device_memory(device)
    kind = "plain" if method == "none" else "round"
    # Steps a request may decode in, each at most a round: while the batch's later prompts are prefilled, then
    # those measured.
    prefill_steps = -(-batch * context // PREFILL_STEP_TOKENS) + 1
    new_tokens = (prefill_steps + WARMUP_STEPS + 2 * samples + 8) * (k + 1)
    wrapped = sparsespec.wrap(
        model,
        draft=None if method == "none" else method,
        k=k,
        max_batch_size=batch,
        kv_capacity_tokens=batch * (context + new_tokens + k),
        max_step_tokens=PREFILL_STEP_TOKENS,
        tensor_parallel_size=tensor_parallel_size,
    )
    engine = wrapped.engine
    sampled = {"do_sample": True, "temperature": temperature, "top_k": TOP_K} if temperature > 0 else {}
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sampled)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(engine.vocab_size, (batch, context), generator=generator).tolist()
    steps = _Steps(engine, [engine.new_request(i, prompt, params) for i, prompt in enumerate(prompts)], batch)
    try:
        timings = _timed(steps, kind, samples)
        busy, attention = _profiled(steps, kind, samples) if device.type == "cuda" else (None, None)
    finally:
        steps.close()
    return StepCost(
        method=method,
        step=kind,
        k=k,
        steps_timed=len(timings),
        wall_ms=1e3 * statistics.median(wall for wall, _ in timings),
        host_ms=1e3 * statistics.median(cpu for _, cpu in timings),
        gpu_busy_ms=busy,
        attention_ms=attention,
    )


def method_costs(model: torch.nn.Module, method: str, **settings: Any) -> list[StepCost]:
    """``none``: its plain step; a draft policy: its rounds at the default k and at ``SHORT_K``."""
    k = SpecConfig().k
    if method == "none":
        return [measure(model, method, k=k, **settings)]
    return [measure(model, method, k=k, **settings), measure(model, method, k=SHORT_K, **settings)]


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def label(cost: StepCost) -> str:
    """The step in words: which method, plain step or round of how many drafts."""
    return f"{cost.method} plain step" if cost.step == "plain" else f"{cost.method} round, k={cost.k}"


def _markdown(results: dict[str, Any], costs: Sequence[StepCost]) -> str:
    env = results["environment"]
    plain = next((cost for cost in costs if cost.step == "plain"), None)
    lines = [
        f"# torchspec bench: step cost of {results['model_config']} (random weights)",
        "",
        f"Command: `{results['command']}`  ",
        f"Environment: {env['device']}, {env['dtype']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"triton {env['triton']}  ",
        f"Shape: {results['shape']}  ",
        f"Batch: {results['batch']} requests of {results['context']} random prompt tokens each, decoding together, "
        f"temperature {results['temperature']} (top-k {TOP_K} when sampling), every engine option at its default.  ",
        *_sharding(results.get("tensor_parallel_size", 1)),
        "**Acceptance is not measured**: random weights draft nothing a trained model would.",
        "",
        "| step | wall ms | host ms | GPU busy ms | attention ms | x plain step |",
        "|---|---|---|---|---|---|",
    ]
    for cost in costs:
        ratio = "-" if plain is None else f"{cost.wall_ms / plain.wall_ms:.2f}"
        lines.append(
            f"| {label(cost)} | {cost.wall_ms:.2f} | {cost.host_ms:.2f} | {_cell(cost.gpu_busy_ms)} | "
            f"{_cell(cost.attention_ms)} | {ratio} |"
        )
    lines += [
        "",
        "Wall and host ms: medians over the timed steps; GPU busy: the time at least one kernel ran, of which "
        "attention (the paged kernel and its split merges); GPU figures are means over as many profiled steps.",
        "",
        *_rounds(costs, plain),
        "",
        f"![{PLOT}]({PLOT})",
    ]
    return "\n".join(lines) + "\n"


def _sharding(size: int) -> list[str]:
    if size == 1:
        return []
    return [
        f"Sharded over {size} GPUs (tensor parallel: each holds 1/{size} of the heads, their K/V and the MLP, with "
        "an all-reduce after o_proj and down_proj); times and GPU figures are the first rank's.  "
    ]


def _rounds(costs: Sequence[StepCost], plain: StepCost | None) -> list[str]:
    """A line per policy: what a draft forward adds to a round (the difference of its two round lengths over
    their difference in drafts), what is left for the verify and the round's fixed work, and the acceptance at
    which the longer round pays (a round emits its accepted drafts and one token, a plain step one token)."""
    lines = []
    for method in dict.fromkeys(cost.method for cost in costs if cost.step == "round"):
        long, short = sorted((c for c in costs if c.method == method), key=lambda c: -c.k)
        draft = (long.wall_ms - short.wall_ms) / (long.k - short.k)
        line = (
            f"- {method}: each draft forward adds {draft:.2f} ms to a round; its verify and fixed work take "
            f"{long.wall_ms - long.k * draft:.2f} ms"
        )
        if long.gpu_busy_ms is not None:
            gpu = (long.gpu_busy_ms - short.gpu_busy_ms) / (long.k - short.k)
            line += f" (GPU busy: {gpu:.2f} and {long.gpu_busy_ms - long.k * gpu:.2f} ms)"
        if plain is not None:
            ratio = long.wall_ms / plain.wall_ms
            line += (
                f". A round of {long.k} pays once it emits more than {ratio:.2f} tokens (accepts more than "
                f"{ratio - 1:.2f} of {long.k} drafts)"
            )
        lines.append(line + ".")
    return lines


def _plot(costs: Sequence[StepCost], path: Path) -> None:
    """Wall time of each (method, step) as a bar, split on a GPU into attention, other GPU time and the rest."""
    figure, axes = new_figure(max(6.0, 1.3 * len(costs)))
    labels = [label(cost).replace(" ", "\n", 1) for cost in costs]
    if all(cost.gpu_busy_ms is not None for cost in costs):
        attention = [cost.attention_ms for cost in costs]
        other = [cost.gpu_busy_ms - cost.attention_ms for cost in costs]
        idle = [max(0.0, cost.wall_ms - cost.gpu_busy_ms) for cost in costs]
        axes.bar(labels, attention, label="attention (GPU)")
        axes.bar(labels, other, bottom=attention, label="other GPU work")
        axes.bar(labels, idle, bottom=[a + o for a, o in zip(attention, other, strict=True)], label="GPU idle")
    else:
        axes.bar(labels, [cost.wall_ms for cost in costs], label="wall time")
    save_plot(figure, axes, path, "method and step", "ms a step")


def write_report(out: Path, results: dict[str, Any], costs: Sequence[StepCost]) -> list[Path]:
    """``results.json``, ``report.md`` and the plot of ``costs`` into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    results = results | {"costs": [dataclasses.asdict(cost) for cost in costs]}
    _plot(costs, out / PLOT)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(_markdown(results, costs))
    return [out / "results.json", out / "report.md", out / PLOT]
