"""The data of a ``torchspec bench`` run: the workload every method decodes, and what one method's run measured.

Every method gets the same requests, sampling and batch size, so their numbers compare side by side."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchspec.workloads import prompt_ids


@dataclass(frozen=True)
class Workload:
    """The requests of a run and how they are decoded: prompts as chat-template token ids, ``output_len`` new
    tokens each (EOS held back; with ``natural_lengths`` a request stops at EOS, at most ``output_len``),
    sampled at ``temperature`` (0: greedy), ``max_batch_size`` requests at once (None: all), a ``seed`` set before
    each timed run, after an untimed warm-up of ``warmup_tokens`` tokens a request (0: none)."""

    prompts: tuple[tuple[int, ...], ...]
    output_len: int
    natural_lengths: bool = False
    temperature: float = 0.65
    max_batch_size: int | None = None
    seed: int = 0
    warmup_tokens: int = 16

    @classmethod
    def from_file(cls, tokenizer: Any, path: str | Path | None, num_prompts: int, **settings: Any) -> Workload:
        """``num_prompts`` prompts of ``path`` (None: the packaged reasoning prompts; cycled when the file has
        fewer) in the tokenizer's chat template."""
        return cls(tuple(map(tuple, prompt_ids(tokenizer, path, num_prompts))), **settings)

    @property
    def batch_size(self) -> int:
        """Requests decoded at once."""
        return min(self.max_batch_size or len(self.prompts), len(self.prompts))

    def summary(self) -> dict[str, Any]:
        """The workload as it goes into the report (prompt lengths instead of the prompts)."""
        lengths = [len(prompt) for prompt in self.prompts]
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "prompts"}
        shape = {"num_prompts": len(lengths), "batch_size": self.batch_size}
        return (
            shape | {"prompt_tokens_min_mean_max": [min(lengths), sum(lengths) / len(lengths), max(lengths)]} | fields
        )


@dataclass
class MethodRun:
    """What one method's timed run measured (the warm-up excluded). Fields an engine does not report are None:
    acceptance without speculation, device memory on a CPU, pool and step times for the peers."""

    method: str
    configuration: str  # how the method ran, in words, for the report
    requests: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    time_per_output_token_ms: float  # a request's latency over its output tokens, averaged over requests
    warmup_s: float
    peak_memory_gib: float | None = None
    k: int | None = None  # drafts per round
    mean_accepted: float | None = None  # accepted drafts per verify round, the verify's own token not counted
    accepted_histogram: list[int] | None = None  # rounds that accepted 0, 1, ..., k drafts
    acceptance_by_context: list[dict] | None = None  # {context_from, rounds, mean_accepted} per context bin
    kv_capacity_tokens: int | None = None
    peak_pool_tokens: int | None = None  # most KV slots held at once
    ms_per_step: float | None = None  # wall time per engine step
    host_ms_per_step: float | None = None  # host CPU time per engine step (all threads)
    offload: dict | None = None  # the KV host tier's counters, where it ran
    memory_before_gib: dict | None = None  # device memory free, allocated and cached as the engine was built
    sweep_value: int | None = None  # the swept setting's value of this run (set by the suite)
