"""Counters of one generate call and of each request, kept small and plain."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torchspec.kv_offload import OffloadStats
from torchspec.request import SpeculationStats


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    generated_tokens: int
    latency_s: float  # arrival to finish
    time_to_first_token_s: float | None
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verify round (the verify's own token not counted, as in the paper)."""
        return self.speculation.num_accepted_tokens / max(1, self.speculation.num_rounds)


@dataclass(frozen=True)
class GenerationStats:
    """What the last ``generate`` / ``generate_batch`` call did."""

    num_requests: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_time_s: float = 0.0
    steps: int = 0
    num_rounds: int = 0  # verify steps that checked drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # accepted drafts, bonus/corrected tokens not counted
    accepted_histogram: tuple[int, ...] = ()  # rounds that accepted 0, 1, ..., k drafts
    offload: OffloadStats | None = None  # what the KV host tier did (``offload=True``; None without it)
    # Host milliseconds spent in each phase of the engine's steps (engine.HOST_PHASES); with steps launched
    # ahead, "read-back" holds the wait for the device.
    host_ms: dict[str, float] = field(default_factory=dict)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verify round (bonus token not counted, as in the paper)."""
        return self.num_accepted_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def summary(self) -> str:
        failed = f", {self.num_failed} failed" if self.num_failed else ""
        return (
            f"{self.num_requests} requests{failed}: {self.prompt_tokens} prompt + {self.generated_tokens} generated "
            f"tokens in {self.wall_time_s:.2f} s ({self.steps} steps), {self.tokens_per_s:.1f} tok/s"
            + (
                f", mean accepted {self.mean_accepted:.2f} of {self.num_draft_tokens / self.num_rounds:.2f} drafted"
                if self.num_rounds
                else ""
            )
        )


def accepted_histogram(stats: Sequence[SpeculationStats], k: int) -> tuple[int, ...]:
    """How many rounds accepted 0, 1, ..., k drafts, over all requests."""
    counts = [0] * (k + 1)
    for request_stats in stats:
        for accepted in request_stats.accepted_per_round:
            counts[accepted] += 1
    return tuple(counts)
