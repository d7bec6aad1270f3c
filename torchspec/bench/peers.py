"""The peers ``torchspec bench`` measures against: transformers' own ways of decoding a batch, each in its
documented configuration for throughput (stated in the report with every run).

- ``hf``: ``generate`` on left-padded batches, dynamic cache.
- ``hf-static``: ``generate`` with ``cache_implementation="static"``; transformers compiles the forward itself
  for a static cache on an accelerator (``torch.compile``, mode ``reduce-overhead``), not on a CPU.
- ``hf-cb``: transformers' continuous batching (``generate_batch``'s manager: paged attention, requests admitted
  as others finish).
"""

from __future__ import annotations

import functools
import pkgutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from torchspec.bench.runs import MethodRun, Workload
from torchspec.bench.throughput import time_per_output_token_ms

#: What each peer needs of the installed transformers, as importable names.
PEER_NEEDS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers.GenerationMixin.generate",),
    "hf-static": ("transformers.StaticCache",),
    "hf-cb": (
        "transformers.ContinuousBatchingConfig",
        "transformers.GenerationMixin.continuous_batching_context_manager",
        "transformers.generation.continuous_batching.utils.WorkloadHints",
    ),
}


def _resolves(name: str) -> bool:
    try:
        pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError):
        return False
    return True


def missing_peer(name: str) -> str | None:
    """A one-line error where the installed transformers lacks what peer ``name`` needs (None: it has it, or
    ``name`` is not a peer)."""
    lacking = [need for need in PEER_NEEDS.get(name, ()) if not _resolves(need)]
    if not lacking:
        return None
    return (
        f"method {name!r} needs {', '.join(lacking)}, which transformers {transformers.__version__} lacks: "
        f"upgrade transformers or leave {name} out"
    )


def _sampling(workload: Workload) -> dict[str, Any]:
    """transformers' sampling arguments for the workload: plain temperature sampling (top-k and top-p off, as
    torchspec samples), or greedy at temperature 0."""
    if workload.temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0}


def _eos_ids(model: torch.nn.Module) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A batch for ``generate``: the prompts padded on the left with ``pad_id``, and its attention mask."""
    width = max(map(len, prompts))
    input_ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    attention_mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return {
        "input_ids": torch.tensor(input_ids, device=device),
        "attention_mask": torch.tensor(attention_mask, device=device),
    }


def _static_cache(device: torch.device) -> str:
    """transformers compiles a static-cache forward itself, on an accelerator only."""
    if device.type == "cpu":
        return "static cache, not compiled (transformers compiles it on an accelerator only)"
    return "static cache, forward compiled by transformers (torch.compile, mode reduce-overhead)"


def _output_tokens(row: Sequence[int], eos_ids: set[int]) -> int:
    """New tokens of one generated row: up to and including its first EOS, else all of them."""
    return next((index + 1 for index, token in enumerate(row) if token in eos_ids), len(row))


class _StopAfter(StoppingCriteria):
    """Ends a warm-up ``generate`` after ``length`` positions, while ``max_new_tokens`` (and so a static cache's
    size, and what is compiled for it) stays the timed run's."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = input_ids.shape[1] >= self.length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


@contextmanager
def _timed(device: torch.device) -> Iterator[dict[str, float | None]]:
    """Wall seconds of the block and the peak device memory in it (GiB, None off CUDA), filled in on exit."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timing: dict[str, float | None] = {}
    start = time.perf_counter()
    yield timing
    if cuda:
        torch.cuda.synchronize(device)
    timing["seconds"] = time.perf_counter() - start
    timing["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None


def _run(
    method: str, configuration: str, requests: Sequence[tuple[float, int]], timing: dict, warmup_s: float
) -> MethodRun:
    """The :class:`MethodRun` of a peer from its requests' (latency, output tokens) and its timing."""
    generated = sum(tokens for _, tokens in requests)
    return MethodRun(
        method=method,
        configuration=configuration,
        requests=len(requests),
        generated_tokens=generated,
        seconds=timing["seconds"],
        tokens_per_s=generated / timing["seconds"],
        time_per_output_token_ms=time_per_output_token_ms(requests),
        warmup_s=warmup_s,
        peak_memory_gib=timing["peak_memory_gib"],
    )


def run_generate(model: torch.nn.Module, tokenizer: Any, workload: Workload, static: bool) -> MethodRun:
    """transformers' ``generate`` on left-padded batches of ``workload.batch_size`` prompts, one after another;
    a dynamic cache, or a static one (``static``). A request's latency is its batch's wall time."""
    device = next(model.parameters()).device
    size = workload.batch_size
    eos_ids = _eos_ids(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids, default=0)
    prompts = workload.prompts
    batches = [_left_padded(prompts[start : start + size], pad_id, device) for start in range(0, len(prompts), size)]
    options = _sampling(workload) | {
        "max_new_tokens": workload.output_len,
        "min_new_tokens": 0 if workload.natural_lengths else workload.output_len,
        "pad_token_id": pad_id,
        "cache_implementation": "static" if static else None,
    }
    warmup_s = 0.0
    if workload.warmup_tokens:
        start = time.perf_counter()
        width = batches[0]["input_ids"].shape[1]
        stop = StoppingCriteriaList([_StopAfter(width + min(workload.warmup_tokens, workload.output_len))])
        model.generate(**batches[0], **options, stopping_criteria=stop)
        warmup_s = time.perf_counter() - start
    requests: list[tuple[float, int]] = []
    torch.manual_seed(workload.seed)
    with _timed(device) as timing:
        for batch in batches:
            start = time.perf_counter()
            rows = model.generate(**batch, **options)[:, batch["input_ids"].shape[1] :].tolist()
            latency = time.perf_counter() - start
            requests += [(latency, _output_tokens(row, eos_ids)) for row in rows]
    cache = _static_cache(device) if static else "dynamic cache"
    configuration = (
        f"transformers generate, batches of {size} left-padded prompts, {cache}, "
        f"{model.config._attn_implementation} attention" + _stops(workload, "min_new_tokens = max_new_tokens")
    )
    return _run("hf-static" if static else "hf", configuration, requests, timing, warmup_s)


def _stops(workload: Workload, held_back: str) -> str:
    return ", stops at EOS" if workload.natural_lengths else f", EOS held back ({held_back})"


def run_continuous_batching(model: torch.nn.Module, tokenizer: Any, workload: Workload) -> MethodRun:
    """transformers' continuous batching: one manager (paged KV cache, ``workload.batch_size`` requests at once)
    serves the warm-up and then the timed requests. A request's latency runs from its arrival to its finish."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device = next(model.parameters()).device
    prompts = [list(p) for p in workload.prompts]
    eos = None if workload.natural_lengths else -1  # -1: no token stops a request
    config = GenerationConfig(max_new_tokens=workload.output_len, eos_token_id=eos, **_sampling(workload))
    batching = ContinuousBatchingConfig(max_requests_per_batch=workload.batch_size, seed=workload.seed)
    longest_prompt = max(map(len, prompts))
    if device.type == "cpu":  # its own sizing takes 90% of the RAM, a minute to allocate; a batch's need instead
        batching.num_blocks = workload.batch_size * -(-(longest_prompt + workload.output_len) // batching.page_size)
    hints = WorkloadHints(longest_prompt, workload.output_len, num_requests=len(prompts))
    manager_context = model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=batching, workload_hints=hints, block=True, timeout=5
    )
    warmup_start = time.perf_counter()
    with manager_context as manager:
        if workload.warmup_tokens:
            _finished(manager, prompts, min(workload.warmup_tokens, workload.output_len))
        warmup_s = time.perf_counter() - warmup_start
        torch.manual_seed(workload.seed)
        with _timed(device) as timing:
            outputs = _finished(manager, prompts, workload.output_len)
        pages = manager.continuous_batching_config.num_blocks  # as resolved by transformers
    requests = [(o.lifespan[1] - o.created_time, len(o.generated_tokens)) for o in outputs]
    configuration = (
        f"transformers continuous batching (generate_batch's manager), paged attention over "
        f"{batching.page_size}-token pages ({pages} of them), "
        f"{workload.batch_size} requests at once" + _stops(workload, "eos_token_id=-1")
    )
    return _run("hf-cb", configuration, requests, timing, warmup_s)


def _finished(manager: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Any]:
    """Submit ``prompts`` to a running continuous-batching manager; their finished outputs, in prompt order."""
    ids = manager.add_requests(inputs=prompts, max_new_tokens=max_new_tokens)
    finished: dict[str, Any] = {}
    while len(finished) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error:
                raise RuntimeError(f"hf-cb: request {result.request_id} failed: {result.error}")
            finished[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("hf-cb: transformers' continuous batching stopped before every request finished")
    return [finished[request_id] for request_id in ids]


#: Peers by method name.
PEERS: dict[str, Callable[..., MethodRun]] = {
    "hf": functools.partial(run_generate, static=False),
    "hf-static": functools.partial(run_generate, static=True),
    "hf-cb": run_continuous_batching,
}
