"""The methods ``torchspec bench`` runs, by name: ours with every draft policy or with none, and transformers'
own ways as peers (torchspec/bench/peers.py)."""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from torchspec.bench import peers
from torchspec.bench.records import parse_setting
from torchspec.bench.runs import MethodRun, Workload
from torchspec.bench.throughput import measure
from torchspec.config import DRAFT_POLICIES


def run_ours(
    model: torch.nn.Module,
    tokenizer: Any,
    workload: Workload,
    draft: str | None,
    options: Mapping[str, bool | int | float] = MappingProxyType({}),
    name: str | None = None,
) -> MethodRun:
    """torchspec's ``generate_batch`` with ``draft`` (None: plain decoding) and ``wrap()`` ``options``, through the
    throughput benchmark; reported as ``name`` (default: the draft, or ``none``)."""
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
        **options,
    )
    drafts = f"draft={draft}, k={record['k']}, sparsity={record['sparsity']}" if draft else "no speculation"
    graphs = "CUDA graphs" if record["graph_captures"] is not None else "no CUDA graphs"
    speculative = draft is not None
    settings = "".join(f"{option}={value}, " for option, value in options.items() if option not in ("k", "sparsity"))
    return MethodRun(
        method=name or draft or "none",
        configuration=f"torchspec generate_batch, {drafts}, {record['max_batch_size']} requests at once, "
        f"KV pool {record['kv_capacity_tokens']} tokens, {graphs}, {settings}other options at their defaults",
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


def method(name: str) -> Method:
    """The method ``name`` runs: one of ``METHODS``, or ours with settings for that run (``pillar_recent+k=4``,
    ``query_sketch+sketch_shortlist=4-compile``: see ``parse_setting``; ``ArgumentTypeError`` if bad)."""
    if name in METHODS:
        return METHODS[name]
    draft, options = parse_setting(name)
    return functools.partial(run_ours, draft=draft, options=options, name=name)


def methods_error(names: Sequence[str]) -> str | None:
    """A one-line error naming the first of ``names`` that is no method or cannot run here (None: all can)."""
    for name in names:
        if name in METHODS:
            continue
        base = re.split(r"[+-]", name)[0]
        if base in peers.PEERS:
            return f"bad method {name!r}: settings (+NAME, -NAME, +NAME=VALUE) apply to torchspec's methods only"
        if base not in METHODS:
            return (
                f"unknown method {name!r}; choose from {', '.join(METHODS)} (torchspec's may carry settings, "
                "e.g. pillar_recent+k=4+sparsity=0.1)"
            )
        try:
            parse_setting(name)
        except argparse.ArgumentTypeError as error:
            return f"bad method {name!r}: {error}"
    return next(filter(None, map(peers.missing_peer, names)), None)
