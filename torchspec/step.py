"""The step vocabulary: what the scheduler plans (a ``StepPlan`` of ``ScheduledRequest``s, each in its ``Phase``),
what every attention layer of a forward reads (``AttentionMetadata`` and its ``KVView`` lists, built by
torchspec/step_metadata.py) and what the runner returns for each request (``StepResult``). Plain data, no
behaviour beyond what a plan derives from its requests."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torchspec.request import Request

if TYPE_CHECKING:
    from torchspec.draft_lists import DraftChoice


class Phase(enum.Enum):
    PREFILL = "prefill"  # a chunk of the prompt; samples when it reaches the prompt's end
    DRAFT = "draft"  # one token with sparse attention; samples a draft token
    VERIFY = "verify"  # newest token + drafts with full attention; accepts drafts, adds one token


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    phase: Phase
    num_query_tokens: int
    # Draft forwards the step runs for a draft request, back to back from ``first_position`` (a draft chain:
    # each feeds the previous draft token on the device); 1 = one draft per step.
    chain: int = 1
    # A draft chain whose verify runs in the same step, after the chain (the whole round in one step).
    verifies: bool = False
    # Positions the step still in flight computes before this one (delayed verification): a decode then feeds
    # the token that step emits, on the device and not yet on the host.
    ahead: int = 0
    # ``ahead`` is an upper bound: the step in flight runs a round of this request, which may accept fewer of its
    # drafts (a round launched ahead, see ``Scheduler._step_ahead``); the device knows the exact start.
    bound: bool = False
    # A verify, a draft chain's verify or a final prompt chunk whose attention the draft policy learns from.
    learns: bool = True
    # Read many times per step and fixed until the step is committed: computed once, when scheduled (a property
    # read per request costs a call each, ~770 of them a plain step at batch 256).
    first_position: int = field(init=False)  # of the first query token (drafts sit after the newest accepted)
    samples: bool = field(init=False)  # the step produces tokens for it (all but a prefill chunk short of the end)
    # Its first input is the request's newest token, which the device holds (the runner puts it there, so a step in
    # flight may have made it: see ``ahead``): a verify's, and a round's first draft's.
    fed: bool = field(init=False)
    checked_drafts: int = field(init=False)  # drafts a verify checks (0 for a draft or a prompt chunk)
    # Logits rows it samples: every row of a verify, one for a draft or a final prompt chunk, none for a prompt
    # chunk short of the end.
    sampled_rows: int = field(init=False)
    # The request's computed count on the device when the step runs: the host's, plus what the step in flight
    # computes before it (``ahead``).
    device_computed: int = field(init=False)
    # Query tokens this request holds in the verify forward of its step's rounds (a chain verified in the same
    # step: its newest token and drafts; else none).
    verify_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        request, phase, queries = self.request, self.phase, self.num_query_tokens
        drafting, verifying = phase is Phase.DRAFT, phase is Phase.VERIFY
        self.device_computed = request.num_computed_tokens + self.ahead
        self.first_position = self.device_computed + (len(request.round.tokens) if drafting else 0)
        self.samples = phase is not Phase.PREFILL or self.first_position + queries == len(request.token_ids)
        self.fed = verifying or (drafting and not request.round.tokens)
        self.checked_drafts = queries - 1 if verifying else 0
        self.sampled_rows = (queries if verifying else 1) if self.samples else 0
        self.verify_tokens = 1 + self.chain if self.verifies else 0

    @property
    def end_position(self) -> int:
        """One past the last position this step computes for the request (its slots must exist)."""
        return self.first_position + self.num_query_tokens + self.chain - 1 + self.verifies

    def advanced(self, steps: int) -> ScheduledRequest:
        """This draft request ``steps`` forwards further along its chain."""
        item = ScheduledRequest(
            self.request, self.phase, self.num_query_tokens, self.chain - steps, ahead=self.ahead, bound=self.bound
        )
        item.first_position += steps
        return item

    def query_token_ids(self) -> list[int]:
        request = self.request
        if self.phase is Phase.PREFILL:
            start = self.first_position
            return request.token_ids[start : start + self.num_query_tokens]
        # 0: a placeholder for the newest token, which the runner feeds from the device (see ``fed``).
        if self.phase is Phase.DRAFT:
            return request.round.tokens[-1:] if not self.fed else [0]
        return [0, *request.round.tokens[: self.num_query_tokens - 1]]


class PlanColumns(NamedTuple):
    """A plan's per-request numbers as NumPy arrays (one entry per scheduled request, in plan order), made in one
    pass over the requests: the runner reads each of them several times a step, where each read was a pass of
    Python over the batch (~25 of them a plain step)."""

    first_position: np.ndarray  # of the first query token
    num_query_tokens: np.ndarray
    is_draft: np.ndarray  # bool
    device_computed: np.ndarray  # the request's computed count on the device when the step runs (``ahead`` on)
    checked_drafts: np.ndarray  # drafts a verify checks (0 for anything else)
    sampled_rows: np.ndarray  # logits rows it samples: a verify's every row, one for a draft or a final chunk
    fed: np.ndarray  # bool: its first input is the newest token, which the device holds (``ScheduledRequest.fed``)
    num_prompt_tokens: np.ndarray


@dataclass
class StepPlan:
    """Plain host data describing one forward step; draft steps come first. With ``offload``, also the KV
    moves the runner makes before it: requests leaving the pool (with the slots their computed positions had,
    in position order), requests coming back (their new slots already in ``Request.slots``), running requests
    given more slots, and requests that ended while it was planned."""

    scheduled: list[ScheduledRequest]
    offloads: list[tuple[Request, list[int]]] = field(default_factory=list)
    restores: list[Request] = field(default_factory=list)
    grown: list[Request] = field(default_factory=list)
    stopped: list[Request] = field(default_factory=list)  # ended while planning (their rows go back)
    # Samples of a prompt that copy its K/V from another's slots (these, in position order) into their own.
    forks: list[tuple[Request, list[int]]] = field(default_factory=list)
    num_drafts: int = field(init=False)  # read several times per step: counted once
    has_prefill: bool = field(init=False)  # some request runs a prompt chunk (the engine, runner and scheduler ask)

    def __post_init__(self) -> None:
        phases = list(map(attrgetter("phase"), self.scheduled))
        self.num_drafts = phases.count(Phase.DRAFT)
        self.has_prefill = Phase.PREFILL in phases

    @property
    def num_tokens(self) -> int:
        return sum(item.num_query_tokens for item in self.scheduled)

    @cached_property
    def columns(self) -> PlanColumns:
        """The scheduled requests' numbers as arrays (a plan is fixed once made: computed on first use)."""
        values = [
            (
                item.first_position,
                item.num_query_tokens,
                item.phase is Phase.DRAFT,
                item.device_computed,
                item.checked_drafts,
                item.sampled_rows,
                item.fed,
                item.request.num_prompt_tokens,
            )
            for item in self.scheduled
        ]
        table = np.array(values, dtype=np.int64).reshape(len(values), len(PlanColumns._fields)).T
        columns = dict(zip(PlanColumns._fields, table, strict=True))
        columns["is_draft"], columns["fed"] = columns["is_draft"].astype(bool), columns["fed"].astype(bool)
        return PlanColumns(**columns)

    @property
    def round_length(self) -> int:
        """Drafts of the longest draft chain in the step (0: no drafts, a plain step)."""
        return max((item.chain for item in self.scheduled if item.phase is Phase.DRAFT), default=0)


@dataclass(slots=True)
class StepResult:
    """What the runner produced for one scheduled request."""

    tokens: list[int] = field(default_factory=list)  # verify/prefill: accepted drafts + one new token
    num_accepted: int = 0  # drafts accepted (verify)
    draft_tokens: list[int] = field(default_factory=list)  # draft step: the drafted token(s), one per forward
    draft_entropy: float | None = None  # draft step: entropy of the draft's distribution (if the policy asks)
    # One row per token of ``tokens`` (host, fp32), when the request's params ask: ``SamplingParams.output_scores``
    # and ``output_logits``.
    scores: torch.Tensor | None = None
    raw_logits: torch.Tensor | None = None


@dataclass
class KVView:
    """The slot lists of a packed batch for one attention kind (full, or one sliding window size)."""

    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [N], or [num_kv_heads, N] for per-head lists
    max_len: int = 0  # longest list, or a bound on it (host-known): a launch hint, and the width of verify mass
    # [B]: where each list ends when not at the next one's start (a draft round's forwards read prefixes of one
    # list per request); None: kv_indptr[1:].
    kv_ends: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Built once per forward (``MetadataBuilder``), read by every layer.

    The first ``num_drafts`` requests are draft steps (one query token each): in full-attention layers they
    read their sparse per-KV-head lists ``draft[layer]``, the other requests read ``full``. Sliding-window
    layers read ``windowed[window]`` for every request. When ``num_scored_queries`` is set, full-attention
    layers also record the attention mass of those requests' last queries in ``mass[mass_layers[layer]]``
    (``[Hkv, verifies, width]``, a row per request that reads ``full``), in the attention's own pass (see
    ``ops.paged_attention``).
    """

    slot_mapping: torch.Tensor  # [T]: where each new token's K/V goes
    cu_seqlens_q: torch.Tensor  # [B + 1]
    windowed: dict[int, KVView]
    full: KVView  # lists of the requests from num_drafts on
    num_drafts: int = 0
    draft: dict[int, KVView] = field(default_factory=dict)  # per full-attention layer: per-KV-head lists
    # The draft views' lists, stacked [sparse layers, Hkv, N] (their storage): one copy fills a graph's buffer.
    draft_lists: torch.Tensor | None = None
    # Query-aware drafts pick their lists inside attention: (layer, draft queries, K cache, scale) -> lists.
    draft_select: Callable[[int, torch.Tensor, torch.Tensor, float], KVView] | None = None
    # Or chosen by the policy on the device, in the forward (query_sketch): what it reads.
    draft_choice: DraftChoice | None = None
    num_scored_queries: torch.Tensor | None = None  # [B - num_drafts]; 0 = not scored
    max_q_len: int = 0  # longest query of a request (a launch hint, known on the host)
    max_scored_queries: int = 0
    # Where the forward writes the verify mass (with num_scored_queries): [mass layers, Hkv, verifies, width],
    # one buffer for all layers, which the draft policy reads in place (no per-layer slices, no stacked copy).
    mass: torch.Tensor | None = None
    mass_layers: dict[int, int] = field(default_factory=dict)  # full-attention layer -> its index in ``mass``
    # [2] on the device: the real drafts and other requests of a graph's bucket, which replays steps of fewer
    # requests than it holds (the rest padding): full-attention layers split the real ones' lists by it.
    live_requests: torch.Tensor | None = None
