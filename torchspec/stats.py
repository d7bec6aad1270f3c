"""Counters of one generate call and of each request, kept small and plain."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    generated_tokens: int
    latency_s: float  # arrival to finish
    time_to_first_token_s: float | None


@dataclass(frozen=True)
class GenerationStats:
    """What the last ``generate`` / ``generate_batch`` call did."""

    num_requests: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_time_s: float = 0.0
    steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def summary(self) -> str:
        failed = f", {self.num_failed} failed" if self.num_failed else ""
        return (
            f"{self.num_requests} requests{failed}: {self.prompt_tokens} prompt + {self.generated_tokens} generated "
            f"tokens in {self.wall_time_s:.2f} s ({self.steps} steps), {self.tokens_per_s:.1f} tok/s"
        )
