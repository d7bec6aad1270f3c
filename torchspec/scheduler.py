"""The one place that decides: which requests run in a step, with how many query tokens, and what follows.

Admission reserves a request's worst-case KV need (prompt + max_new_tokens), so a running request never
runs out of slots and nothing is ever evicted or recomputed: requests that do not fit wait for slots.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from torchspec.kv_cache import SlotAllocator
from torchspec.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_query_tokens: int  # tokens fed this step, from request.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """Whether this step's last query token is the request's newest token, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_query_tokens == len(self.request.token_ids)


@dataclass
class StepPlan:
    """Plain host data describing one forward step."""

    scheduled: list[ScheduledRequest]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)


class Scheduler:
    """FIFO admission under a batch-size and KV reservation limit, chunked prefill, one-token decode."""

    def __init__(self, allocator: SlotAllocator, max_batch_size: int, max_step_tokens: int) -> None:
        self.allocator = allocator
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._reserved_slots = 0

    def add(self, request: Request) -> None:
        """Queue a request; it must fit the pool on its own (the caller checks, with a clear error)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Decodes first (one token each), then prefill chunks of running and newly admitted requests."""
        self._admit()
        budget = self.max_step_tokens
        scheduled: list[ScheduledRequest] = []
        # Decoding requests need one token each; chunked prefills share what is left of the budget.
        for request in sorted(self.running, key=lambda r: r.num_pending_tokens > 1):
            if budget == 0:
                break
            count = min(request.num_pending_tokens, budget)
            request.slots.extend(self.allocator.allocate(count))
            scheduled.append(ScheduledRequest(request, count))
            budget -= count
        return StepPlan(scheduled)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            if self._reserved_slots + request.max_total_tokens > self.allocator.num_slots:
                break
            self.waiting.popleft()
            self._reserved_slots += request.max_total_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def commit(self, plan: StepPlan, sampled_tokens: list[int | None]) -> list[Request]:
        """Record this step's computed K/V and sampled tokens; finish and release requests that are done.

        Returns the requests that finished in this step.
        """
        finished = []
        for item, token in zip(plan.scheduled, sampled_tokens, strict=True):
            request = item.request
            request.num_computed_tokens += item.num_query_tokens
            if token is None:
                continue
            request.token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = time.perf_counter()
            if token in request.params.stop_token_ids and request.num_output_tokens >= request.params.min_new_tokens:
                self.finish(request, FinishReason.STOP)
                finished.append(request)
            elif request.num_output_tokens >= request.params.max_new_tokens:
                self.finish(request, FinishReason.LENGTH)
                finished.append(request)
        return finished

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a running request at once and give its slots and reservation back."""
        request.finish(reason)
        self.running.remove(request)
        self.allocator.free(request.slots)
        request.slots = []
        self._reserved_slots -= request.max_total_tokens
