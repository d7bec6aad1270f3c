"""The methods ``torchspec bench`` runs, by name: ours with every draft policy or with none, and transformers'
own ways as peers (torchspec/bench/peers.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchspec.bench import peers
from torchspec.bench.runs import MethodRun, Workload
from torchspec.bench.throughput import measure
from torchspec.config import DRAFT_POLICIES


def run_ours(model: torch.nn.Module, tokenizer: Any, workload: Workload, draft: str | None) -> MethodRun:
    """torchspec's ``generate_batch`` with ``draft`` (None: plain decoding), through the throughput benchmark."""
    record = measure(
        model,
        workload.prompts,
        draft,
        workload.output_len,
        workload.temperature,
        seed=workload.seed,
        warmup_tokens=workload.warmup_tokens,
        natural_lengths=workload.natural_lengths,
        max_batch_size=workload.batch_size,
    )
    drafts = f"draft={draft}, k={record['k']}, sparsity={record['sparsity']}" if draft else "no speculation"
    graphs = "CUDA graphs" if record["graph_captures"] is not None else "no CUDA graphs"
    speculative = draft is not None
    return MethodRun(
        method=draft or "none",
        configuration=f"torchspec generate_batch, {drafts}, {record['max_batch_size']} requests at once, "
        f"KV pool {record['kv_capacity_tokens']} tokens, {graphs}, other options at their defaults",
        requests=record["requests"],
        generated_tokens=record["generated_tokens"],
        seconds=record["seconds"],
        tokens_per_s=record["tokens_per_s"],
        time_per_output_token_ms=record["time_per_output_token_ms"],
        warmup_s=record["warmup_s"],
        peak_memory_gib=record["peak_memory_gib"],
        k=record["k"],
        mean_accepted=record["mean_accepted"] if speculative else None,
        accepted_histogram=record["accepted_histogram"] if speculative else None,
        acceptance_by_context=record["acceptance_by_context"] if speculative else None,
        kv_capacity_tokens=record["kv_capacity_tokens"],
        peak_pool_tokens=record["peak_pool_tokens"],
        ms_per_step=record["ms_per_step"],
        host_ms_per_step=record["cpu_ms_per_step"],
        offload=record["offload"],
        memory_before_gib=record["memory_before_gib"],
    )


Method = Callable[[torch.nn.Module, Any, Workload], MethodRun]

#: Every method by name: ours without speculation (``none``) and with each draft policy, then the peers.
METHODS: dict[str, Method] = {
    "none": functools.partial(run_ours, draft=None),
    **{policy: functools.partial(run_ours, draft=policy) for policy in DRAFT_POLICIES},
    **peers.PEERS,
}


def methods_error(names: Sequence[str]) -> str | None:
    """A one-line error naming the methods of ``names`` that do not exist or cannot run here (None: all can)."""
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        return f"unknown method {', '.join(map(repr, unknown))}; choose from {', '.join(METHODS)}"
    return next(filter(None, map(peers.missing_peer, names)), None)
