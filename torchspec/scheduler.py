"""The one place that decides: which requests run in a step, in which phase, and what their results mean.

Phases: a request prefills its prompt in chunks, then repeats rounds of up to k *draft* steps (one token,
sparse attention, or tokens proposed outright) and one *verify* step (the newest accepted token plus the
drafts, full attention). A round without drafts is a plain decode step, so ``draft=None`` is the same loop.
With ``draft_chain`` a request runs its whole round within one engine step: its draft forwards back to back
(the runner feeds each draft token to the next forward on the device), then the verify forward, fed the
drafts on the device too. A round then costs the host one plan and one read-back, not k + 1, and the GPU
runs the round's k + 1 forwards without waiting for the host in between.

Delayed verification (``schedule(in_flight=...)``): the engine plans and launches step N + 1 before it reads
step N back. A request in step N whose result fixes what it does next on the host sits step N + 1 out. One
whose next step is known without it runs on, ``ahead`` positions past what the host has committed: a prompt
chunk that does not sample is followed by the next chunk; a step that emits exactly one token and leaves
nothing to decide (a plain decode or a final prompt chunk, without speculation) is followed by a decode fed
the token step N leaves on the device. Stop conditions then apply one step late, and a token made past a stop
is discarded at commit.

With draft chains (``rounds_ahead``), a request whose whole round is in flight runs its next round in step N + 1
too: the device knows where that round starts (the round in flight leaves each request's computed count and
newest token there) and the host, which does not, bounds it by assuming every draft of the round in flight is
accepted (``ScheduledRequest.bound``); the runner builds every position, slot, list and mask of such a round
on the device. Without draft chains (``stagger``) a request's next round waits for its last one to be read
back, so the decoding requests are split in two halves that alternate: each step starts the rounds of at most
half of them, and the engine launches the other half's step while this one runs. The host then reads back,
commits and plans one half while the GPU runs the other's rounds, instead of the GPU idling while the host works
(the paper's delayed verification over two phase buckets).

Unified schedule (``unified``, the paper's phase buckets, one draft per step): a request's first round is cut so
that its verify lands in the step ahead with the fewest verifies; every later round takes k + 1 steps, so the
batch's verifies stay spread over a round's phases and each step is one forward of about B / (k + 1) verifies,
the rest drafting: one steady shape, where requests left in phase make k draft forwards and then one verify
forward of the whole batch.

Admission gives a request the slots of its worst-case KV need (prompt + max_new_tokens + k draft slots), one
per position it may ever compute, so a running request never runs out of slots, nothing is evicted or
recomputed, and a position's slot is known before any step computes it: requests that do not fit wait.

Admission by use (``offload``): a request is admitted with slots for its prompt and two rounds (the one in flight
and the next), and every step first tops each running request up to that (oldest first, in chunks). When the
pool cannot, the most recently admitted requests leave it: their K/V moves to the host tier
(torchspec/kv_offload.py), their slots are freed, and they wait at the head of the queue; once slots free up
they come back (new slots, their K/V copied in) before any new request is admitted, once the pool has room for
them and for the running batch's next ``RESTORE_ROUNDS`` rounds. A request with a step in
flight cannot move: it sits the next step out and moves once that step is read back. So the oldest requests
always run, finish first, and nothing is recomputed. The plan carries the moves; the runner makes them before
the step's forwards.

Samples of one prompt (``num_return_sequences``) prefill it once: the first prefills the prompt up to its last
k + 1 tokens and the others (``Request.prefix_source``) wait meanwhile, then copy that K/V into their own slots (a
move of the plan, ``StepPlan.forks``) and all of them compute the last k + 1 tokens, the queries a final prompt
chunk teaches the draft policy from, and sample their own first tokens. Each request keeps slots of its own
(copies, not shared slots), so freeing, offloading and the slot table need nothing new; a sample whose source
is not there to copy from (it waits, sits the step out, left the pool or finished) prefills on its own.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from torchspec.drafting import DraftPolicy
from torchspec.kv_cache import SlotAllocator
from torchspec.kv_offload import OffloadStats
from torchspec.request import DraftRound, FinishReason, Request, RequestStatus
from torchspec.round_length import RoundLength
from torchspec.step import Phase, ScheduledRequest, StepPlan, StepResult
from torchspec.stopping import CriteriaBatch

# Slots a request running with ``offload`` gets at a time, at least (fewer top-ups, each a slot-table write).
SLOT_CHUNK = 32
# A request on the host comes back only when the pool can also carry the running batch's growth for this many
# rounds (or this share of the pool, on a pool too small for that), so that a move's copies are paid by rounds
# of work before the pool is short again. Without it a full pool traded one request out for another every step
# (W3 on an H100 moved 22.9M tokens out and 21.4M back in 577 steps).
RESTORE_ROUNDS = 16
RESTORE_POOL_SHARE = 8
# ``budget_by_misses``: a request's recent misses follow its rounds with this time constant, and no request's
# draft budget grows past this many times its even one (the step's lists are sized for about even budgets).
MISS_ROUNDS = 16
MAX_DRAFT_WEIGHT = 3.0


class Scheduler:
    """FIFO admission under batch-size and KV limits, chunked prefill, speculation rounds."""

    def __init__(
        self,
        allocator: SlotAllocator,
        max_batch_size: int,
        max_step_tokens: int,
        policy: DraftPolicy | None,
        k: int,
        draft_chain: bool = False,
        adaptive_rounds: bool = False,
        stagger: bool = False,
        unified: bool = False,
        rounds_ahead: bool = False,
        offload: OffloadStats | None = None,
        host_capacity_tokens: int = 0,
        draft_step_budget: int = 0,
        budget_by_misses: bool = False,
        restore_step_tokens: int | None = None,
        host_refusal: Callable[[list[int]], str | None] | None = None,
    ) -> None:
        self.allocator = allocator
        self.draft_step_budget = draft_step_budget  # KV tokens a step's drafts read together, shared out
        self.budget_by_misses = budget_by_misses  # each request's draft budget weighted by its recent misses
        # Admission by use, with the host tier (None: worst-case reservations), and the counters it keeps.
        self.offload = offload
        self.host_capacity_tokens = host_capacity_tokens
        self.host_tokens = 0  # K/V rows of the requests on the host
        # Why the host cannot take requests of so many K/V rows each (None: it can), asked before one is sent out
        # (``HostKVStore.refusal``: its memory); and the latest such answer this step, for the error it may end in.
        self.host_refusal = host_refusal
        self._refused: str | None = None
        # K/V rows a step brings back at most, after its first request (None: no bound).
        self.restore_step_tokens = restore_step_tokens
        self.offloaded: list[Request] = []  # waiting to come back, oldest admission first
        self._leaving: set[int] = set()  # id() of requests to offload once their step in flight is read back
        self._admission: dict[int, int] = {}  # id() of a request in the pool or on the host -> admission order
        self._admitted = 0
        self._moves = StepPlan([])  # the moves decided for the step being planned
        self._fork_at: dict[int, int] = {}  # id() of a request whose prompt others wait for -> where they copy it
        self.stagger = stagger  # each step starts at most half of the decoding requests' rounds
        # A request's next step is launched while its round (or plain step) is in flight (draft chains, delayed).
        self.rounds_ahead = rounds_ahead
        # Unified phase buckets: a request's first round is cut so that verifies spread over a round's k + 1 steps.
        self.unified = unified and policy is not None
        self._phased: set[int] = set()  # id() of the decoding requests whose first round was placed so
        # Verifies in each of the next k + 1 steps (0: this one), counted when a step first places a request.
        self._verifies_ahead: list[int] | None = None
        self.draft_chain = draft_chain  # a request runs its whole round (drafts, verify) in one step
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.policy = policy
        self.k = k if policy is not None else 0
        self.round_length = RoundLength(self.k, adaptive_rounds)
        self._length = self.k  # drafts of the rounds the current step starts (chosen once per step)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a request; it must fit the pool on its own (the caller checks, with a clear error)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.offloaded)

    def reservation(self, request: Request) -> int:
        return request.max_total_tokens + self.k

    def schedule(self, in_flight: StepPlan | None = None) -> StepPlan:
        """Draft and verify steps first (one per decoding request), then prefill chunks within the budget.
        ``in_flight``: the step launched and not yet committed (delayed verification, see the module docstring)."""
        self._moves = StepPlan([])
        blocked: set[int] = set()  # id() of requests that sit this step out: leaving, or short of slots
        if self.offload is not None:
            in_flight_ids = {id(item.request) for item in in_flight.scheduled} if in_flight is not None else set()
            blocked = self._make_room(in_flight_ids)
        self._admit()
        blocked |= self._share_prompts(blocked)
        if self.policy is not None:
            self.policy.step_share = self.draft_step_budget // max(1, len(self.running))
            if self.budget_by_misses:
                self._weigh_draft_budgets()
        starts = self._max_starts(blocked)
        if self.round_length.adaptive and starts:
            starting = [r.spec_stats for r in self.running if r.decoding and r.round.length is None]
            self._length = self.round_length.choose(starting)
        pending = {id(item.request): item for item in in_flight.scheduled} if in_flight is not None else {}
        self._verifies_ahead = None
        decoding: list[tuple[Request, ScheduledRequest]] = []
        prefilling: list[tuple[Request, None, int]] = []  # no step yet: its chunk is sized below, ``ahead`` on
        for request in self.running:
            if id(request) in blocked:
                continue
            item = pending.get(id(request))
            if item is None:
                if request.decoding:
                    if len(decoding) < starts:
                        decoding.append((request, self._next_step(request)))
                else:
                    prefilling.append((request, None, 0))
                continue
            ahead = item.end_position - request.num_computed_tokens  # what the step in flight computes
            if item.phase is Phase.PREFILL and not item.samples:
                prefilling.append((request, None, ahead))
            elif len(decoding) >= starts:
                continue
            elif self._runs_on(item):
                decoding.append((request, ScheduledRequest(request, Phase.VERIFY, 1, ahead=ahead)))
            elif (ahead_step := self._step_ahead(request, item)) is not None:
                decoding.append((request, ahead_step))
        # Each forward of the step holds at most max_step_tokens: the first (drafts, verifies, prompt chunks) and
        # the verify forward of the rounds drafted in the step.
        budget = verify_budget = self.max_step_tokens
        scheduled: list[ScheduledRequest] = []
        drafting = False  # some scheduled request drafts (else the order needs no sort)
        candidates = [(request, item, 0) for request, item in decoding] + prefilling  # decoding first, order kept
        for request, item, ahead in candidates:
            if item is None:
                if budget == 0:
                    break
                first = request.num_computed_tokens + ahead
                size = min(request.num_pending_tokens - ahead, budget)
                if first < self._fork_at.get(id(request), 0):  # stop where the samples waiting for it copy
                    size = min(size, self._fork_at[id(request)] - first)
                item = ScheduledRequest(request, Phase.PREFILL, size, ahead=ahead)
            elif (item.num_query_tokens > budget or item.verify_tokens > verify_budget) and scheduled:
                break
            budget = max(0, budget - item.num_query_tokens)
            verify_budget -= item.verify_tokens
            scheduled.append(item)
            drafting = drafting or item.phase is Phase.DRAFT
        # Drafts first, longest chain first: a chain's later forwards then hold a prefix of the step's drafts.
        if drafting:
            scheduled.sort(key=lambda item: (item.phase is not Phase.DRAFT, -item.chain))
        moves = self._moves
        return StepPlan(scheduled, moves.offloads, moves.restores, moves.grown, moves.stopped, moves.forks)

    def _share_prompts(self, blocked: set[int]) -> set[int]:
        """Decide, for each sample of a prompt still waiting for its ``prefix_source`` (see the module docstring),
        whether it copies the prompt's K/V in this step's moves, goes on waiting, or prefills on its own (no
        source to copy from, or a prompt of at most k + 1 tokens). Returns those that wait this step, and notes
        where their sources' prefills stop for them (``_fork_at``)."""
        waiting: set[int] = set()
        self._fork_at = {}
        for request in self.running:
            source = request.prefix_source
            if source is None or id(request) in blocked:
                continue
            shared = request.num_prompt_tokens - self.k - 1
            if shared < 1 or source.status is not RequestStatus.RUNNING or id(source) in blocked:
                request.prefix_source = None
            elif source.num_computed_tokens >= shared:
                request.prefix_source = None
                request.num_computed_tokens = shared
                self._moves.forks.append((request, source.slots[:shared]))
            else:
                waiting.add(id(request))
                self._fork_at[id(source)] = shared
        return waiting

    def _max_starts(self, blocked: set[int]) -> int:
        """Decoding requests whose next step this step may start: none while the batch fills (``_filling``), all
        of them, or half with ``stagger`` (rounded up, counting those in flight: the other half is the step in
        flight, or the next one)."""
        if self._filling(blocked):
            return 0
        if not self.stagger:
            return self.max_batch_size
        return -(-sum(request.decoding for request in self.running) // 2)

    def observe_step(self, plan: StepPlan, wall_ms: float, draft_ms: float | None) -> None:
        """Report a step's cost to the round length: its wall time and what one of its later draft forwards
        took (None: none ran). Decoding steps only: a step with prompt chunks costs what no round costs."""
        if plan.has_prefill:
            return
        self.round_length.observe(len(plan.scheduled), plan.round_length, wall_ms, draft_ms)

    def _filling(self, blocked: set[int]) -> bool:
        """The batch is still filling: its pending prompt tokens exceed one step's budget. Its steps then only
        prefill, and decoding starts (or goes on) once the rest fits one step (prompts that sit the step out,
        ``blocked``, do not count: the decoding requests may be what they wait for). A batch decoding while it fills
        runs each step at another batch size, and each size captures its graphs (and compiles kernel variants)
        once, for a step or two: W3 with offload, its 1,024 requests admitted at once, captured ~45 of its 69
        graphs on its way up (~2.7 s), and W1 spent 35 s of its first 20 steps so before graphs were shared.
        A newcomer joining a running batch usually fits one step, so decoding goes on around it; one whose prompt
        is longer than a step's budget pauses the others for the steps its prompt takes."""
        pending = sum(
            request.num_pending_tokens
            for request in self.running
            if not request.decoding and id(request) not in blocked
        )
        return pending > self.max_step_tokens

    def _runs_on(self, item: ScheduledRequest) -> bool:
        """Whether a request of the step in flight runs in the next step too (fed its token on the device): its
        step emits exactly one token and leaves nothing to decide (no speculation), and a token is left to make
        after the one in flight."""
        return self.policy is None and item.samples and item.request.remaining_tokens > 1

    def _step_ahead(self, request: Request, item: ScheduledRequest) -> ScheduledRequest | None:
        """The next step of a request whose round, plain step or final prompt chunk is in flight
        (``rounds_ahead``), launched before that one is read back: a round where the step's round length and the
        policy allow, else a plain step. It starts where the step in flight leaves the request: past a plain
        step or a prompt chunk, known on the host; past a round the device knows where, and the host bounds it
        by assuming every draft accepted (``bound``), so the next round drafts no more than the tokens still
        allowed after the most the round in flight can emit. None (the request sits this step out) when it may
        stop in the step in flight."""
        if not self.rounds_ahead or not item.samples:
            return None
        if item.verifies:  # at most its newest token and every draft computed, as many tokens emitted
            ahead, emits, bound = item.chain + 1, item.chain + 1, True
        elif item.phase is Phase.PREFILL or item.num_query_tokens == 1:  # a final prompt chunk, a plain step
            ahead, emits, bound = item.num_query_tokens, 1, False
        else:
            return None
        left = request.remaining_tokens - emits  # at least this many tokens after the step in flight
        if left < 1:
            return None
        length = min(self._length, left - 1)
        if length > 0 and self.policy.ready(request):
            learns = self.policy.learns_from_round(request)
            return ScheduledRequest(
                request, Phase.DRAFT, 1, length, verifies=True, ahead=ahead, learns=learns, bound=bound
            )
        learns = self.policy.learns_from_plain_step(request)
        return ScheduledRequest(request, Phase.VERIFY, 1, ahead=ahead, learns=learns, bound=bound)

    def _next_step(self, request: Request) -> ScheduledRequest:
        if self.policy is None:  # plain decoding: every step is a one-token verify, rounds never start
            return ScheduledRequest(request, Phase.VERIFY, 1)
        current = request.round
        if current.length is None:
            self._start_round(request)
        if self.draft_chain and current.length:  # the whole round: every draft, then the verify
            learns = self.policy.learns_from_round(request)
            return ScheduledRequest(request, Phase.DRAFT, 1, current.length, verifies=True, learns=learns)
        if len(current.tokens) < current.length:
            return ScheduledRequest(request, Phase.DRAFT, 1)
        # A round's verify or a plain step teaches the policy when it asks for it.
        learns = (
            self.policy.learns_from_round(request) if current.tokens else self.policy.learns_from_plain_step(request)
        )
        return ScheduledRequest(request, Phase.VERIFY, 1 + len(current.tokens), learns=learns)

    def _start_round(self, request: Request) -> None:
        """Choose this round's drafts: the step's round length, and never more than the tokens still allowed;
        under the unified schedule a request's first round ends in the step ahead with the fewest verifies."""
        current = request.round
        length = min(self._length, request.remaining_tokens - 1)
        if self.unified and id(request) not in self._phased:
            if self._verifies_ahead is None:  # counted before this step places anyone, once per step
                self._verifies_ahead = self._count_verifies_ahead()
            self._phased.add(id(request))
            phase = min(range(self.k + 1), key=self._verifies_ahead.__getitem__)
            self._verifies_ahead[phase] += 1
            length = min(length, phase)
        if self.policy is None or length <= 0 or not self.policy.ready(request):
            current.length = 0
        elif self.policy.proposes_tokens:
            current.tokens = self.policy.propose(request, length)
            current.length = len(current.tokens)
        else:
            current.length = length

    def _count_verifies_ahead(self) -> list[int]:
        """Verifies of the placed decoding requests in each of the next k + 1 steps (0: this one): a round in
        progress verifies once its drafts are made; one starting now, after k drafts (or the tokens allowed)."""
        counts = [0] * (self.k + 1)
        for request in self.running:
            if id(request) not in self._phased:
                continue
            current = request.round
            if current.length is None:
                steps = min(self.k, request.remaining_tokens - 1)
            else:
                steps = current.length - len(current.tokens)
            counts[max(0, min(steps, self.k))] += 1
        return counts

    def _admit(self) -> None:
        """Start waiting requests while the batch and the pool have room: with ``offload``, those on the host
        first (oldest first), each with the slots of its next two rounds and room left for the running requests'
        next ``RESTORE_ROUNDS`` rounds (a new request: their next round) and, after the first, as many as
        ``restore_step_tokens`` allows; else each with its worst case."""
        restored = 0  # K/V rows this step brings back
        while len(self.running) < self.max_batch_size:
            restoring = self.offload is not None and bool(self.offloaded)
            if not restoring and not self.waiting:
                return
            request = self.offloaded[0] if restoring else self.waiting[0]
            if self.offload is None:
                need, room = self.reservation(request), 0
            else:
                need, room = self._slots_needed(request), self._room(restoring)
            if need + room > self.allocator.num_free or (restoring and self._over_budget(restored, request)):
                return
            request.slots = self.allocator.allocate(need)
            request.status = RequestStatus.RUNNING
            if restoring:
                self.offloaded.pop(0)
                restored += request.num_computed_tokens
                self.host_tokens -= request.num_computed_tokens
                self._moves.restores.append(request)
            else:
                self.waiting.popleft()
                self._admission[id(request)] = self._admitted
                self._admitted += 1
            bisect.insort(self.running, request, key=lambda r: self._admission.get(id(r), 0))
            self._note_use()

    def _room(self, restoring: bool) -> int:
        """Slots left free besides an admitted request's own: the running batch's next round, or for a request
        coming back from the host its next ``RESTORE_ROUNDS`` rounds (at most a ``RESTORE_POOL_SHARE`` of the pool)."""
        if not restoring:
            return (self.k + 1) * len(self.running)
        return min(RESTORE_ROUNDS * (self.k + 1) * len(self.running), self.allocator.num_slots // RESTORE_POOL_SHARE)

    def _over_budget(self, restored: int, request: Request) -> bool:
        """Whether bringing ``request`` back too would stage more than ``restore_step_tokens`` rows this step (the
        step's first restore never is)."""
        budget = self.restore_step_tokens
        return bool(restored) and budget is not None and restored + request.num_computed_tokens > budget

    def _slots_needed(self, request: Request) -> int:
        """Slots a request admitted by use holds before a step: its tokens and two rounds (the one in flight, if
        any, and the next), never more than its worst case."""
        return min(self.reservation(request), len(request.token_ids) + 2 * (self.k + 1))

    def _make_room(self, in_flight: set[int]) -> set[int]:
        """Top the running requests up (``_top_up``); returns those that sit this step out. Should none of them
        be able to run, with no step in flight and none leaving, the host tier is too full to take the requests
        that would make room: the most recently admitted one between rounds then ends with an error naming the
        host tier's size (its tokens so far kept), so that the others complete."""
        while True:
            blocked = self._top_up(in_flight)
            if in_flight or self._leaving or not self.running or any(id(r) not in blocked for r in self.running):
                return blocked
            stuck = next((r for r in reversed(self.running) if not r.round.tokens), self.running[-1])
            self.finish(stuck, FinishReason.ERROR)
            fix = (
                f" ({self._refused}); free host memory or raise kv_capacity_tokens"
                if self._refused
                else "; raise host_kv_capacity_tokens or kv_capacity_tokens"
            )
            stuck.error = (
                f"stopped after {stuck.num_output_tokens} tokens: the KV pool ({self.allocator.num_slots} slots) "
                f"was full and the host tier (host_kv_capacity_tokens={self.host_capacity_tokens}, "
                f"{self.host_tokens} in use) could not take its {stuck.num_computed_tokens} K/V rows to make room" + fix
            )
            self._moves.stopped.append(stuck)

    def _top_up(self, in_flight: set[int]) -> set[int]:
        """Top each running request up to ``_slots_needed``, oldest first, offloading the most recently admitted
        ones (this one included, when it is the newest) where the pool is short. Returns the requests that sit
        this step out: leaving once their step in flight is read back, or short of slots with no one to move.

        The slots of requests leaving after the step in flight are promised to the short requests that sit out
        waiting for them, once each: counting them for every short request evicted a victim per short request
        (W3 sent 200-300 requests out at once, all of them back a step later, ~40 times in 230 s)."""
        self._refused = None
        for request in [r for r in self.running if id(r) in self._leaving and id(r) not in in_flight]:
            if self._host_takes(request):
                self._offload(request)
            else:  # grown past what the host takes since it was chosen: it stays
                self._leaving.discard(id(request))
        blocked = set(self._leaving)
        freeing = sum(len(r.slots) for r in self.running if id(r) in blocked)  # free once the step in flight ends
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or id(request) in blocked:  # it left for the host
                continue
            short = self._slots_needed(request) - len(request.slots)
            if short <= 0:
                continue
            while short > self.allocator.num_free + freeing:
                victim = self._victim(request, blocked)
                if victim is None:
                    break
                if id(victim) in in_flight:
                    self._leaving.add(id(victim))
                    blocked.add(id(victim))
                    freeing += len(victim.slots)
                else:
                    self._offload(victim)
            if request.status is not RequestStatus.RUNNING:  # it was the newest: it left
                continue
            if short > self.allocator.num_free:
                blocked.add(id(request))
                freeing = max(0, freeing - short)
                continue
            grant = min(max(short, SLOT_CHUNK), self.reservation(request) - len(request.slots), self.allocator.num_free)
            request.slots.extend(self.allocator.allocate(grant))  # in place: a copy would cost the whole context
            self._moves.grown.append(request)
            self._note_use()
        return blocked

    def _victim(self, request: Request, leaving: set[int]) -> Request | None:
        """The most recently admitted running request, ``request`` itself at the latest, that can leave the pool:
        not already leaving, between rounds (no drafts waiting for their verify in a later step) and with room
        on the host for its K/V."""
        order = self._admission[id(request)]
        for candidate in reversed(self.running):
            if self._admission[id(candidate)] < order:
                return None
            if id(candidate) not in leaving and not candidate.round.tokens and self._host_takes(candidate):
                return candidate
        return None

    def _host_takes(self, request: Request) -> bool:
        """Whether the host tier takes ``request``'s K/V besides the step's moves so far: within
        ``host_capacity_tokens``, and with memory the host gives (else ``_refused`` says why not)."""
        if self.host_tokens + request.num_computed_tokens > self.host_capacity_tokens:
            return False
        if self.host_refusal is not None:
            rows = [len(slots) for _, slots in self._moves.offloads] + [request.num_computed_tokens]
            self._refused = self.host_refusal(rows)
        return self._refused is None

    def _offload(self, request: Request) -> None:
        """Move a request out of the pool: its K/V to the host (the plan's move), its slots freed, and it waits
        at the head of the queue, in admission order."""
        self._leaving.discard(id(request))
        request.prefix_source = None  # back in the pool, a sample that waited for it prefills on its own
        computed = request.num_computed_tokens
        self._moves.offloads.append((request, request.slots[:computed]))
        self.allocator.free(request.slots)
        request.slots = []
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self._phased.discard(id(request))
        self.host_tokens += computed
        self.offload.peak_host_tokens = max(self.offload.peak_host_tokens, self.host_tokens)
        bisect.insort(self.offloaded, request, key=lambda r: self._admission[id(r)])

    def _note_use(self) -> None:
        if self.offload is not None:
            used = self.allocator.num_slots - self.allocator.num_free
            self.offload.peak_device_tokens = max(self.offload.peak_device_tokens, used)

    def commit(self, plan: StepPlan, results: list[StepResult]) -> list[Request]:
        """Apply each step's results: drafts recorded, verified tokens accepted, rejected drafts' slots freed,
        finished requests released. Returns the requests that finished in this step."""
        finished = []
        for item, result in zip(plan.scheduled, results, strict=True):
            request = item.request
            if request.is_finished:  # stopped by the step before (delayed verification): a token past its stop
                continue
            if item.phase is Phase.DRAFT:
                current = request.round
                current.tokens.extend(result.draft_tokens)
                if not item.verifies:
                    if result.draft_entropy is not None:
                        current.entropies.append(result.draft_entropy)
                    if not self.policy.continue_drafting(request):
                        current.length = len(current.tokens)
                    continue
            if item.phase is Phase.PREFILL:
                request.num_computed_tokens += item.num_query_tokens
                if not item.samples:
                    continue
            else:  # a verify, or a draft chain verified in the same step
                self._record_round(request, item, result)
                if request.round.tokens:
                    self.policy.on_round_end(request, result.num_accepted)
                # The newest token and the accepted drafts keep their (exact, verified) K/V; the rejected drafts'
                # positions are computed again by a later step, into the same slots.
                request.num_computed_tokens += 1 + result.num_accepted
                if self.policy is not None:  # a round ran (its length set or not: one launched ahead): start afresh
                    request.round = DraftRound(pattern=request.round.pattern, recent_start=request.round.recent_start)
            if self._append(request, result):
                finished.append(request)
        return finished

    def _weigh_draft_budgets(self) -> None:
        """Each running request's draft weight (``SpecConfig.budget_by_misses``): 1 + its recent misses per round,
        over the batch's mean of the same (the batch reads about what even budgets read), at most
        ``MAX_DRAFT_WEIGHT``. The answers whose drafts fall short draft from more of their context, the ones whose
        drafts all pass (loops) from less: on W1 the slowest answers (~4.8 of 8 accepted against a median of 6.9)
        set the run's last 12 s, drafting alone at the same budgets."""
        misses = np.fromiter((r.spec_stats.recent_misses for r in self.running), np.float64, len(self.running))
        weights = np.minimum((1 + misses) / (1 + misses.mean()), MAX_DRAFT_WEIGHT)
        for request, weight in zip(self.running, weights.tolist(), strict=True):
            request.draft_weight = weight

    def _record_round(self, request: Request, item: ScheduledRequest, result: StepResult) -> None:
        drafted = len(request.round.tokens)
        if drafted == 0:
            return
        stats = request.spec_stats
        stats.recent_misses += (drafted - result.num_accepted - stats.recent_misses) / MISS_ROUNDS
        stats.num_rounds += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += result.num_accepted
        stats.accepted_per_round.append(result.num_accepted)
        stats.drafts_per_round.append(drafted)
        stats.context_per_round.append(request.num_computed_tokens)  # where it started (a bound item's is exact now)

    def _append(self, request: Request, result: StepResult) -> bool:
        """Append accepted tokens (and their scores, when kept), up to and including the first that stops the
        request: a stop token (once ``min_new_tokens`` are out), the first after which its stopping criteria say
        stop, or the one that reaches ``max_new_tokens``; True when the request finished. The tokens past it are
        discarded."""
        params, produced, tokens = request.params, request.num_output_tokens, result.tokens
        kept, reason = len(tokens), None
        for count, token in enumerate(tokens, start=produced + 1):  # outputs once this token is appended
            if token in params.stop_token_ids and count >= params.min_new_tokens:
                reason = FinishReason.STOP
            elif count >= params.max_new_tokens:
                reason = FinishReason.LENGTH
            else:
                continue
            kept = count - produced
            break
        if params.stopping_criteria is not None and kept:  # one test per commit when there are none
            if request.criteria is None:  # a request of its own (not one of a generate call's rows)
                request.criteria = CriteriaBatch([request.prompt_ids], params.max_new_tokens, pad_token_id=0)
            stop = request.criteria.first_stop(params.stopping_criteria, request.criteria_row, produced, tokens[:kept])
            if stop is not None:
                kept, reason = stop + 1, FinishReason.STOP
        request.token_ids.extend(tokens[:kept])
        for rows, kept_rows in ((result.scores, request.scores), (result.raw_logits, request.raw_logits)):
            if rows is not None and kept:
                kept_rows.append(rows[:kept])
        if request.first_token_time is None and kept:
            request.first_token_time = time.perf_counter()
        if reason is not None:
            self.finish(request, reason)
        return reason is not None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a running request at once and give its slots back."""
        request.finish(reason)
        self.running.remove(request)
        self._phased.discard(id(request))
        self._admission.pop(id(request), None)
        self._leaving.discard(id(request))
        self.allocator.free(request.slots)
        request.slots = []
