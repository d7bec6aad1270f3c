"""Data-parallel replicas: the prompts split over the model replicas of a torch.distributed world, each run by
its own engine, and the outputs gathered back in input order.

Replica ``r`` is the tensor-parallel group of ranks ``r * T ... (r + 1) * T - 1`` (``T`` =
``tensor_parallel_size``): all of its ranks run the same prompts, and its first rank reports them.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from torchspec.causal_lm import RequestOutput, SparseSpecForCausalLM, by_request_id
from torchspec.stats import RequestStats

Prompt = str | Sequence[int]


def balanced_split(costs: Sequence[int], replicas: int) -> list[list[int]]:
    """Indices of ``costs`` per replica, the largest first to the least loaded replica (longest processing
    time first), so replicas finish about together; each replica's indices ascending. Deterministic: every
    rank computes the same split from the same prompts."""
    loads = [(0, replica) for replica in range(replicas)]
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, replica = heapq.heappop(loads)
        shares[replica].append(index)
        heapq.heappush(loads, (load + costs[index], replica))
    return [sorted(share) for share in shares]


def generate_replicated(
    model: SparseSpecForCausalLM, inputs: Sequence[Prompt], **kwargs: Any
) -> dict[str, RequestOutput]:
    """``model.generate_batch(inputs, **kwargs)`` with the prompts split over the world's replicas (balanced by
    prompt length plus ``max_new_tokens``: characters stand in for tokens in text prompts). Every rank calls it
    with the same inputs and gets every output, keyed by request id in input order, as ``generate_batch``
    returns them. A replica whose run raises reports its prompts as errors (``finish_reason="error"``) and the
    others complete."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model.generate_batch(inputs, **kwargs)
    size = model.spec_config.tensor_parallel_size
    replicas, rank = dist.get_world_size() // size, dist.get_rank()
    replica = rank // size
    decode = kwargs.get("max_new_tokens") or 0
    share = balanced_split([len(prompt) + decode for prompt in inputs], replicas)[replica]
    try:
        outputs = model.generate_batch([inputs[i] for i in share], **kwargs)
        outputs = [dataclasses.replace(output, index=share[output.index]) for output in outputs.values()]
    except Exception as error:  # the replica's failure is its requests' errors; the others go on
        message = f"replica {replica} (rank {rank}) failed: {type(error).__name__}: {error}"
        outputs = [_failed(i, inputs[i], message) for i in share]
    gathered: list[list[RequestOutput] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outputs if rank % size == 0 else None)
    return by_request_id(
        sorted((output for part in gathered if part is not None for output in part), key=lambda o: o.index)
    )


def _failed(index: int, prompt: Prompt, message: str) -> RequestOutput:
    prompt_ids = [] if isinstance(prompt, str) else list(prompt)
    return RequestOutput(
        index=index,
        prompt_ids=prompt_ids,
        token_ids=[],
        text=None,
        finish_reason="error",
        error=message,
        stats=RequestStats(len(prompt_ids), generated_tokens=0, latency_s=0.0, time_to_first_token_s=None),
    )
