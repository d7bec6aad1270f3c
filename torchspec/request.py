"""Request: one prompt's tokens, KV slots, sampling parameters and life cycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torchspec.stopping import CriteriaBatch


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV slots: not started yet, or its K/V moved to the host tier (offload)
    RUNNING = "running"  # prefilling (in chunks) or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # produced a stop (EOS) token
    LENGTH = "length"  # reached max_new_tokens
    ERROR = "error"  # rejected; see Request.error


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (transformers' semantics)."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    # transformers' RepetitionPenaltyLogitsProcessor (greedy too): the logits of every token the request holds,
    # prompt and output, divided by it where positive, multiplied where negative. 1 = off.
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # transformers' MinPLogitsWarper (sampling only, after top-p); 0 = off
    stop_token_ids: tuple[int, ...] = ()
    # transformers stopping criteria (a ``StoppingCriteriaList``: a callable of ``(input_ids, scores)`` that returns
    # a bool or a bool per row), checked on the host as tokens are committed, on the rows of the request's batch
    # (``Request.criteria``, torchspec/stopping.py), with ``scores=None``. None: none (the commit loop pays nothing).
    stopping_criteria: Any = field(default=None, compare=False)
    # Keep, for every output token, the distribution it was chosen from as transformers' ``generate`` reports it
    # with ``output_scores`` (the logits after every processor and warper) and ``output_logits`` (the model's raw
    # logits): ``Request.scores`` / ``Request.raw_logits``, one fp32 row of the vocabulary per token.
    output_scores: bool = False
    output_logits: bool = False
    # Read per request several times a step: set once (a property's call each time, at batch 256, is host time).
    greedy: bool = field(init=False, repr=False, compare=False)  # argmax: no sampling, or temperature 0
    # Its tokens' logits change with the tokens it holds (the runner then tracks them on the device).
    penalises: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "greedy", not self.do_sample or self.temperature == 0.0)
        object.__setattr__(self, "penalises", self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad value and its valid range."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.top_p is None or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.repetition_penalty is None or not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1.0 disables it, above 1 discourages repeats), "
                f"got {self.repetition_penalty!r}"
            )
        if self.min_p is None or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")


@dataclass
class DraftRound:
    """The speculation round a request is in: drafts made so far and what the draft steps attend to."""

    length: int | None = None  # drafts to make this round; None until the round starts
    tokens: list[int] = field(default_factory=list)
    pattern: Any = None  # the draft policy's state, e.g. PillarAttn's Top-K positions per (layer, KV head)
    recent_start: int = 0  # first position written since the last verify: every draft step attends to it on
    entropies: list[float] = field(default_factory=list)  # each draft's predictive entropy (when a policy asks)
    # Per sparse layer: what a query-aware policy chose at the round's first draft step, reused by the round's
    # later drafts (PillarQuest's older positions); a new round starts with none.
    selections: dict[int, Any] = field(default_factory=dict)
    chose: bool = False  # a policy choosing on the device made the round's first choice (query_sketch)


@dataclass
class SpeculationStats:
    """Per-request counters of speculation (all zero without a draft policy)."""

    num_rounds: int = 0  # verify steps that checked at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # accepted drafts; the verify's own (bonus or corrected) token not counted
    accepted_per_round: list[int] = field(default_factory=list)
    drafts_per_round: list[int] = field(default_factory=list)  # drafts each of those verifies checked
    context_per_round: list[int] = field(default_factory=list)  # context length at each of those verifies
    # Drafts rejected per round lately (each round moves it 1/16 of the way to its own count): how far the
    # request's drafts fall short, which ``budget_by_misses`` weighs its draft budget by.
    recent_misses: float = 0.0


@dataclass(eq=False)  # one request is one object: found in the scheduler's lists by identity, not by its fields
class Request:
    """State of one generation request inside the engine.

    ``token_ids`` holds the prompt followed by every generated token; ``num_computed_tokens`` of them have
    their K/V in the pool, at ``slots[i]`` for position ``i``. A step feeds the tokens from
    ``num_computed_tokens`` on (a prefill chunk, or the one newest token when decoding) and samples when the
    last token was fed.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    round: DraftRound = field(default_factory=DraftRound)
    draft_weight: float = 1.0  # the scheduler's weight on its draft budget (``SpecConfig.budget_by_misses``)
    spec_stats: SpeculationStats = field(default_factory=SpeculationStats)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Read per request many times per step (a property's call, at batch 256, is host time a step pays): kept.
    num_prompt_tokens: int = field(init=False)
    table_row: int | None = field(default=None, init=False)  # its row of the runner's slot table, while it holds one
    # The rows its stopping criteria read (those of its ``generate`` call, each with the caller's input row ahead
    # of its tokens, as in transformers), and its own; None: a batch of its prompt alone, made at the first commit.
    criteria: CriteriaBatch | None = field(default=None, repr=False)
    criteria_row: int = 0
    # Another sample of this request's prompt (``num_return_sequences``): the request whose prompt K/V it copies
    # instead of prefilling the prompt again, until the scheduler copies it or gives up (``Scheduler._share_prompts``).
    prefix_source: Request | None = field(default=None, repr=False)

    # One [tokens, vocabulary] fp32 tensor per commit that appended tokens, when its params ask (see SamplingParams).
    scores: list[torch.Tensor] = field(default_factory=list, repr=False)
    raw_logits: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.num_prompt_tokens = len(self.prompt_ids)

    def fork(self, request_id: int, criteria_row: int = 0) -> Request:
        """Another sample of this request's prompt (``num_return_sequences``), which copies the prompt's K/V from
        this one rather than prefilling it again; a request that failed its checks forks into the same failure."""
        child = Request(
            request_id, list(self.prompt_ids), self.params, criteria=self.criteria, criteria_row=criteria_row
        )
        if self.is_finished:
            child.finish(self.finish_reason, self.error)
        else:
            child.prefix_source = self
        return child

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V is not computed yet (the rest of the prompt, or the newest token)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold (its drafts' slots come on top)."""
        return self.num_prompt_tokens + self.params.max_new_tokens

    @property
    def decoding(self) -> bool:
        """Past the prompt: only the newest token, a sampled one, lacks K/V, so the next step drafts or verifies
        (fed it on the device). A one-token prompt also lacks K/V for one token, but is prefilled first."""
        return self.num_pending_tokens == 1 and self.num_output_tokens > 0

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_new_tokens - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()
