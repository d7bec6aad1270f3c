"""Host time of an engine step on its own: the decoding forward replaced by random logits.

    python -m benchmarks.host_step --batch 256 --drafts none pillar_recent pillar_recent+delayed_verify

With CUDA graphs the GPU forward of a decoding step is one replay, so what remains of a step is host work:
scheduling, slot lists, token selection, speculation bookkeeping. This measures that floor on any machine (no
GPU needed): a tiny random Llama with SmolLM2's vocabulary runs the prefill for real, then every decoding step
goes through the padded static path of ``cuda_graphs=True`` with the forward swapped for random logits (and
random verify scores); the static buffers are filled as for a replay (a plain step's graph also builds its
inputs, selects its tokens and advances the slot table on the device: the stand-in does none of it, and its
tokens are zeros). The vocabulary is small on purpose: on a
GPU the work over the whole vocabulary (softmax, sampling) is device time, not host time, and on a CPU it
would swamp what this measures. Reported: the median wall time of full-batch decoding steps (everything the engine
does per step, the stand-ins for graph replays included; every other step), the median count of tensor ops the
other steps dispatch outside the replays, all their ops split by part of the step, and the engine lines that
dispatch the most of them.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import pstats
import random
import statistics
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

import torchspec
from torchspec import sparsespec
from torchspec.bench.records import append_record, environment, parse_setting
from torchspec.request import SamplingParams
from torchspec.step import Phase

VOCAB_SIZE = 512
TOP_SITES = 25  # engine lines reported by ops dispatched
ENGINE_ROOT = Path(torchspec.__file__).resolve().parent  # the torchspec package


def _tiny_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=30,  # SmolLM2's depth: per-layer host work (draft lists, verify scores) counts
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    return LlamaForCausalLM(config).eval()


#: Methods whose tensor ops the op count attributes to a part of the step (outermost wins), per owner; the rest
#: (chain and verify assembly, read-back, scheduling) count as "other". The replays' parts are what a GPU
#: runs inside a CUDA graph: their ops cost the host nothing there.
OP_PARTS = {
    "runner": {"_learn_from_verify": "verify learning"},
    "picker": {"pick": "token selection"},
    "builder": {"build": "step metadata", "round_lists": "draft lists"},
    "graphs": {"_fill": "graph inputs", "_run_forward": "replay (stand-in)"},
    "chain_graphs": {"_fill": "chain graph inputs", "_run": "chain replay (stand-in)"},
}
REPLAYED_PARTS = {"replay (stand-in)", "chain replay (stand-in)"}  # not counted in ops_per_step


class _OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched while active, per part of the step: on a GPU each costs the host
    a dispatch and usually a kernel launch (~5-20 us), which a CPU run underweights, so the count is reported
    next to the time as the machine-independent measure of a step's host work."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.sites: dict[str, int] = {}  # "file:function:line" of the innermost engine frame -> ops
        self._parts: list[str] = []

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts, self.sites = {}, {}

    def attribute(self, owner: object, name: str, label: str) -> None:
        """Count the ops of ``owner.name`` (a method, replaced on the instance) under ``label``."""
        method = getattr(owner, name)

        def counted(*args, **kwargs):
            self._parts.append(self._parts[-1] if self._parts else label)
            try:
                return method(*args, **kwargs)
            finally:
                self._parts.pop()

        setattr(owner, name, counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        part = self._parts[-1] if self._parts else "other"
        self.counts[part] = self.counts.get(part, 0) + 1
        if part not in REPLAYED_PARTS:
            site = _engine_site(sys._getframe(1))
            self.sites[site] = self.sites.get(site, 0) + 1
        return func(*args, **(kwargs or {}))


def _engine_site(frame: types.FrameType | None) -> str:
    """Where the engine dispatched an op: the innermost frame in the ``torchspec`` package."""
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if ENGINE_ROOT in path.parents:
            return f"{path.relative_to(ENGINE_ROOT)}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside the engine)"


def measure(
    batch: int,
    prompt_len: int,
    new_tokens: int,
    draft: str | None,
    temperature: float,
    seed: int = 0,
    top_k: int = 50,
    profile_top: int = 0,
    **options: bool,
) -> dict:
    """Median host time of a full-batch decoding step of ``batch`` requests (forward replaced), and the host
    time per token those steps emitted (a chained step drafts a whole round: longer, and fewer of them).
    ``top_k``: sampling's top-k, W1's by default (transformers' 50, which ``generate_batch`` applies); it keeps a
    round's draft token selection out of the chain graph, so it changes what a step runs. ``options``: engine
    switches (``draft_chain``, ``delayed_verify``, ...; left out: the engine's defaults on a CPU). ``profile_top``:
    also profile a quarter of the full-batch steps (neither timed nor counted) with ``cProfile`` and report the
    engine functions with the most own time per step (Python the host runs per request: what a step's inputs
    built from per-row device state would remove), this many of them."""
    model = _tiny_model(seed)
    wrapped = sparsespec.wrap(
        model, draft=draft, max_batch_size=batch, min_budget=16, **({"cuda_graphs": True} | options)
    )
    engine = wrapped.engine
    graphs = engine.runner.graphs
    sparse_layers = engine.policy.sparse_layers if engine.policy is not None else []
    generator = torch.Generator().manual_seed(seed)
    # Random logits and verify scores are drawn once and sliced at a random offset per step: drawing them anew
    # cost ~4 ms of a 16 ms pillar_recent step, time the engine's host does not spend (on a GPU: the replay).
    draw = {  # a bank of `length` along its sliced dimension
        "logits": lambda length: torch.randn(length, VOCAB_SIZE, generator=generator),
        "masses": lambda length: torch.rand(len(sparse_layers), 2, length, generator=generator),  # flat, cut below
    }
    banks: dict[str, torch.Tensor] = {}

    def bank_slice(name: str, dim: int, length: int) -> torch.Tensor:
        if name not in banks or banks[name].shape[dim] < length:  # (re)drawn at twice the longest need yet
            banks[name] = draw[name](2 * length)
        start = int(torch.randint(banks[name].shape[dim] - length + 1, (), generator=generator))
        return banks[name].narrow(dim, start, length)

    def random_forward(step):
        static = step.metadata
        if static.num_scored_queries is not None:
            verifies, width = static.full.kv_indptr.shape[0] - 1, static.full.max_len
            static.mass = bank_slice("masses", 2, verifies * width).unflatten(2, (verifies, width))
        return bank_slice("logits", 0, step.input_ids.shape[1])

    graphs._run_forward = random_forward
    chain_graphs = engine.runner.chain_graphs
    if chain_graphs is not None:  # its forwards too: random logits of the bucket's rows
        chain_graphs.forward = lambda input_ids, **_: SimpleNamespace(
            logits=bank_slice("logits", 0, input_ids.shape[1])[None]
        )
    counter = _OpCounter()
    owners = {
        "runner": engine.runner,
        "builder": engine.runner.builder,
        "picker": engine.runner.picker,
        "graphs": graphs,
        "chain_graphs": chain_graphs,
    }
    for owner, parts in OP_PARTS.items():
        for name, label in parts.items():
            if owners[owner] is not None:
                counter.attribute(owners[owner], name, label)
    params = SamplingParams(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=temperature > 0,
        temperature=temperature or 1.0,
        top_k=top_k,
    )
    requests = [
        engine.new_request(i, torch.randint(VOCAB_SIZE, (prompt_len,), generator=generator).tolist(), params)
        for i in range(batch)
    ]
    step_times: list[float] = []
    step_tokens: list[int] = []
    op_counts: list[int] = []
    part_counts: list[dict[str, int]] = []
    site_counts: dict[str, int] = {}
    steps = iter(engine.steps(requests))
    # Half the steps count ops (the count slows them), the others are timed: chosen at random, because chained
    # drafts and verifies can alternate step by step and a fixed alternation would time only one kind.
    coin = random.Random(seed)
    profiled, profiled_steps = None, 0
    for _ in tqdm(itertools.count(), desc=f"host steps ({draft})", unit="step"):
        toss = coin.random()
        counting, profiling = toss < 0.5, profile_top > 0 and toss >= 0.75
        counter.reset()
        emitted = sum(request.num_output_tokens for request in requests)
        profiler = cProfile.Profile() if profiling else None
        start = time.perf_counter()
        with counter if counting else profiler or contextlib.nullcontext():
            plan, _ = next(steps, (None, None))
        elapsed = time.perf_counter() - start
        if plan is None:
            break
        decoding = all(item.phase is not Phase.PREFILL for item in plan.scheduled)
        if decoding and len(plan.scheduled) == batch:
            if profiling:
                profiled = pstats.Stats(profiler) if profiled is None else profiled.add(profiler)
                profiled_steps += 1
            elif counting:
                replayed = sum(n for part, n in counter.counts.items() if part in REPLAYED_PARTS)
                op_counts.append(counter.count - replayed)
                part_counts.append(counter.counts)
                for site, count in counter.sites.items():
                    site_counts[site] = site_counts.get(site, 0) + count
            else:
                step_times.append(elapsed)
                step_tokens.append(sum(request.num_output_tokens for request in requests) - emitted)
    stats = engine.stats_for(requests)
    return {
        "draft": draft,
        "options": {name: str(value) for name, value in options.items()},
        "batch": batch,
        "steps_timed": len(step_times),
        "draft_chain": engine.draft_chain,
        "rounds_ahead": engine.rounds_ahead,
        "top_k": top_k,
        "host_ms_per_step": 1e3 * statistics.median(step_times),
        "host_us_per_token": 1e6 * sum(step_times) / max(sum(step_tokens), 1),
        # Tensor ops the host dispatches (each a launch or more on a GPU), the replays' stand-ins left out.
        "ops_per_step": statistics.median(op_counts),
        # Their mean split by part of the step ("run_forward": the random stand-in for the replay).
        "ops_by_part": {
            part: sum(counts.get(part, 0) for counts in part_counts) / len(part_counts)
            for part in sorted({part for counts in part_counts for part in counts})
        },
        # Where they come from: the engine lines dispatching the most ops per step (the next cuts to make).
        "ops_by_site": {
            site: count / len(part_counts)
            for site, count in sorted(site_counts.items(), key=lambda item: -item[1])[:TOP_SITES]
        },
        # Own time of the engine's functions per profiled step (cProfile's overhead included), the most first.
        "profiled_steps": profiled_steps,
        "own_ms_per_step": _own_times(profiled, profiled_steps, profile_top),
        # Python function calls per profiled step, C functions included: what a step runs per request and per op,
        # counted exactly where its time is noisy (a pass over a 256-request batch is ~260 of them).
        "python_calls_per_step": None if profiled is None else profiled.total_calls / profiled_steps,
        "tokens_per_step": stats.generated_tokens / max(stats.steps, 1),
        "rounds": stats.num_rounds,
        "mean_accepted": stats.mean_accepted,
        **environment("cpu", torch.float32),
    }


def _own_times(profiled: pstats.Stats | None, steps: int, top: int) -> dict[str, float]:
    """The ``top`` functions of the torchspec package by own time, in ms per profiled step."""
    if profiled is None:
        return {}
    own = {}
    for (path, line, name), (_, _, tottime, _, _) in profiled.stats.items():
        file = Path(path)
        if ENGINE_ROOT in file.parents:
            own[f"{file.relative_to(ENGINE_ROOT)}:{line}({name})"] = 1e3 * tottime / steps
    return dict(sorted(own.items(), key=lambda item: -item[1])[:top])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.65)
    parser.add_argument("--top-k", type=int, default=50, help="sampling's top-k (W1: transformers' default 50)")
    parser.add_argument(
        "--drafts",
        nargs="+",
        default=["none", "pillar_recent"],
        help="runs, each a draft policy or none, optionally with +switch / -switch (e.g. pillar_recent-draft_chain)",
    )
    parser.add_argument("--out", help="append one JSON line per draft setting")
    parser.add_argument(
        "--profile-top", type=int, default=0, help="also report the N engine functions with the most own time a step"
    )
    args = parser.parse_args(argv)
    try:
        settings = [(text, *parse_setting(text)) for text in args.drafts]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    for text, draft, options in settings:
        record = measure(
            args.batch,
            args.prompt_len,
            args.new_tokens,
            draft,
            args.temperature,
            top_k=args.top_k,
            profile_top=args.profile_top,
            **options,
        )
        record["setting"] = text
        print(
            f"{text} (draft_chain={record['draft_chain']}, rounds_ahead={record['rounds_ahead']}, top_k="
            f"{args.top_k}): {record['host_ms_per_step']:.2f} ms of host time "
            f"and {record['ops_per_step']:.0f} tensor ops per step, {record['host_us_per_token']:.0f} us per "
            f"token, at batch {args.batch}; ops by part: "
            + ", ".join(f"{part} {count:.0f}" for part, count in record["ops_by_part"].items())
        )
        print("  ops per step by engine line: " + ", ".join(
            f"{site} {count:.0f}" for site, count in itertools.islice(record["ops_by_site"].items(), 12)
        ))  # fmt: skip
        if record["own_ms_per_step"]:
            print(f"  own ms per step ({record['profiled_steps']} steps profiled, "
                  f"{record['python_calls_per_step']:.0f} Python calls each): " + ", ".join(
                f"{name} {ms:.2f}" for name, ms in record["own_ms_per_step"].items()
            ))  # fmt: skip
        append_record(args.out, record)


if __name__ == "__main__":
    main()
