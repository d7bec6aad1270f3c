"""Speculation is lossless in greedy decoding, and its bookkeeping adds up.

Every draft policy must give exactly the tokens of ``draft=None`` (plain greedy decoding) on tiny random
models, whatever the draft length, budget, batch schedule, KV capacity, stop tokens or sliding windows; the
speculation counters must agree with each other, with the per-request stats and with what the engine really
did (recorded by spying on the runner and the policy). Budgets are mostly small (``min_budget=8``,
``sparsity=0.1`` on 40-174 token contexts) so draft steps really attend sparsely (random tiny models then
reject most drafts); a middling budget (48) and one covering the context exercise accepted drafts. Engine
tests check that rounds happened, so none passes vacuously, and that no KV slot leaked.
"""

from __future__ import annotations

import itertools
import unittest.mock
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from attention import reference
from tests.torchspec.conftest import (
    FIRST_PROMPT_TOKEN,
    PAD_TOKEN_ID,
    Batch,
    TinyModelSpec,
    assert_no_slot_leak,
    generated_rows,
    tiny_spec,
)
from torchspec import SpecConfig, sparsespec
from torchspec.config import DRAFT_POLICIES
from torchspec.draft_lists import DraftChoice, DraftForward
from torchspec.drafting import POLICIES, pillar
from torchspec.drafting.pillar import PillarPolicy
from torchspec.drafting.pillar_quest import PillarQuestPolicy
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request, SamplingParams
from torchspec.runner import LaunchedStep
from torchspec.step import Phase, StepResult
from torchspec.workloads import chat_token_ids, read_prompts

pytestmark = pytest.mark.usefixtures("single_thread")

POLICY_NAMES = list(POLICIES)
MAX_NEW_TOKENS = 24
KV_CAPACITY = 1024  # plenty, unless a test says otherwise
SPARSE = {"min_budget": 8, "sparsity": 0.1}  # 8-15 of 40-170 positions: drafts really are sparse
DENSE = {"min_budget": 256}  # covers every context here: drafts attend to everything

GQA = tiny_spec("llama", 2)  # 4 query heads over 2 KV heads
MHA = tiny_spec("qwen3", 4)  # one KV head per query head
SLIDING = "sliding_attention"
FULL = "full_attention"
SLIDING_SPECS = [
    tiny_spec("qwen3", use_sliding_window=True, sliding_window=8, layer_types=[FULL, SLIDING]),
    tiny_spec("qwen3", 4, use_sliding_window=True, sliding_window=16, layer_types=[SLIDING, FULL]),
    tiny_spec("mistral", sliding_window=16),  # every layer windowed: no layer drafts sparsely
]


@dataclass(frozen=True)
class MixedBatch(Batch):
    """Random prompts, every other one a short random phrase repeated (so n-gram lookups find matches)."""

    period: int = 7

    @property
    def prompts(self) -> list[list[int]]:
        prompts = super().prompts
        for i in range(1, len(prompts), 2):
            n = len(prompts[i])
            prompts[i] = (prompts[i][: self.period] * n)[:n]
        return prompts


BATCH = MixedBatch((40, 77, 150, 101))


def _ids(specs: Sequence[TinyModelSpec]) -> list[str]:
    return [spec.id for spec in specs]


# -- spies ---------------------------------------------------------------------------------------------------
@dataclass
class Verify:
    """One verify (or plain decode) step of one request, as the runner saw it."""

    request: Request
    first_position: int
    drafts: list[int]
    num_accepted: int
    tokens: list[int]


@dataclass
class DraftCall:
    """One request's ``draft_positions`` (or query-aware ``select_for_drafts``) answer: the draft position, the
    positions it attends to, and the policy's state for the request at that time."""

    request_id: int
    position: int
    positions: torch.Tensor
    pattern: Any
    recent_start: int


def attended_positions(chosen: tuple[torch.Tensor, int], position: int) -> torch.Tensor:
    """Every position a draft step reads, from a policy's ``draft_positions``: its fixed positions, then the
    recent run up to the draft position."""
    fixed, first_recent = chosen
    recent = torch.arange(first_recent, position + 1, device=fixed.device)
    return torch.cat([fixed, recent.expand(*fixed.shape[:-1], -1)], dim=-1)


@dataclass
class Recorder:
    """Spies on a wrapper's runner (every step's plan and results) and draft policy (every draft step's
    positions); ``reset()`` between calls."""

    verifies: list[Verify] = field(default_factory=list)
    draft_calls: list[DraftCall] = field(default_factory=list)
    prefill_samples: list[Request] = field(default_factory=list)  # last prompt chunks, which sample a token
    step_tokens: list[int] = field(default_factory=list)
    step_prefill_tokens: list[int] = field(default_factory=list)
    step_requests: list[set[int]] = field(default_factory=list)
    mixed_steps: int = 0  # steps holding a prefill chunk next to a draft or verify
    step_phases: list[set[Phase]] = field(default_factory=list)
    # Each draft request of each step: (draft forwards chained, drafts its round held before, round length).
    draft_items: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def attach(cls, wrapped: Any, monkeypatch: pytest.MonkeyPatch) -> Recorder:
        recorder = cls()
        runner, policy = wrapped.engine.runner, wrapped.engine.policy
        collect = runner.collect

        def spy_collect(step: LaunchedStep) -> list[StepResult]:
            plan = step.plan
            # Where each item starts: a bound item (launched ahead of a round) starts where that round ended,
            # which the host knows now, the round before this step being committed.
            before = [
                (item, item.request.num_computed_tokens if item.bound else item.first_position,
                 list(item.request.round.tokens), item.samples)
                for item in plan.scheduled
            ]  # fmt: skip
            results = collect(step)
            recorder.step_tokens.append(plan.num_tokens)
            recorder.step_prefill_tokens.append(
                sum(item.num_query_tokens for item in plan.scheduled if item.phase is Phase.PREFILL)
            )
            recorder.step_requests.append({item.request.request_id for item in plan.scheduled})
            phases = {item.phase for item in plan.scheduled}
            recorder.step_phases.append(phases)
            recorder.mixed_steps += Phase.PREFILL in phases and len(phases) > 1
            for (item, first_position, drafts, samples), result in zip(before, results, strict=True):
                if item.phase is Phase.DRAFT:
                    recorder.draft_items.append((item.chain, len(drafts), item.request.round.length))
                    assert len(result.draft_tokens) == item.chain
                    if item.verifies:  # the whole round in this step: its verify too
                        assert not drafts
                        recorder.verifies.append(
                            Verify(item.request, first_position, result.draft_tokens, result.num_accepted,
                                   list(result.tokens))
                        )  # fmt: skip
                if item.phase is Phase.VERIFY:
                    assert item.num_query_tokens == 1 + len(drafts)
                    recorder.verifies.append(
                        Verify(item.request, first_position, drafts, result.num_accepted, list(result.tokens))
                    )
                elif item.phase is Phase.PREFILL and samples:
                    recorder.prefill_samples.append(item.request)
            return results

        monkeypatch.setattr(runner, "collect", spy_collect)
        if policy is None or policy.proposes_tokens:
            return recorder
        if policy.chooses_on_device:
            name = "choose_lists"
        elif policy.selects_in_attention:
            name = "select_for_drafts"
        else:
            name = "draft_positions"
        positions_of = getattr(policy, name)

        def record(request: Request, position: int, chosen: tuple[torch.Tensor, int]) -> None:
            state = request.round
            recorder.draft_calls.append(
                DraftCall(
                    request.request_id, position, attended_positions(chosen, position), state.pattern,
                    state.recent_start,
                )
            )  # fmt: skip

        def spy_positions(request: Request, position: int, *args: Any) -> Any:
            chosen = positions_of(request, position, *args)
            record(request, position, chosen)
            return chosen

        def spy_selections(forward: DraftForward) -> Any:
            fixed, recent_from = positions_of(forward)
            for request, position, chosen, first_recent in zip(
                forward.requests, forward.positions, fixed, recent_from, strict=True
            ):
                record(request, position, (chosen, int(first_recent)))
            return fixed, recent_from

        def spy_choice(choice: DraftChoice, layer: int, *args: Any) -> Any:
            view = positions_of(choice, layer, *args)
            if layer == policy.sparse_layers[0]:  # each draft once: its lists' positions (slots mapped back)
                for j, (row, position) in enumerate(zip(choice.rows.tolist(), choice.positions.tolist(), strict=True)):
                    slots = view.kv_indices[:, int(view.kv_indptr[j]) : int(view.kv_ends[j])]
                    at = (slots[..., None] == choice.table[row, : position + 1]).int().argmax(dim=-1)
                    attended = torch.where(slots >= 0, at, -1).sort(dim=-1).values  # in position order
                    record(runner.table._holders[row], position, (attended, position + 1))
            return view

        spy = {"choose_lists": spy_choice, "select_for_drafts": spy_selections}.get(name, spy_positions)
        monkeypatch.setattr(policy, name, spy)
        return recorder

    def reset(self) -> None:
        self.__init__()

    def requests(self) -> list[Request]:
        """Every request that produced a token, by id."""
        seen = {id(r): r for r in [*self.prefill_samples, *(v.request for v in self.verifies)]}
        return sorted(seen.values(), key=lambda r: r.request_id)

    def emitted(self, request: Request) -> int:
        """Tokens the steps produced for ``request`` (a stop token may have cut the last step's short)."""
        from_prefill = sum(r is request for r in self.prefill_samples)
        return from_prefill + sum(len(v.tokens) for v in self.verifies if v.request is request)


# -- running and checking ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline():
    """``baseline(spec, batch, **generate_kwargs)``: draft=None greedy ``generate`` output, computed once per
    module and checked to have no speculation counters (callers get a copy)."""
    cache: dict[tuple, torch.Tensor] = {}

    def run(spec: TinyModelSpec, batch: Batch, **kwargs: Any) -> torch.Tensor:
        key = (spec, batch, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
        if key not in cache:
            wrapped = sparsespec.wrap(spec.build(), draft=None, kv_capacity_tokens=KV_CAPACITY)
            cache[key] = wrapped.generate(**batch.kwargs(), do_sample=False, **_lengths(kwargs))
            stats = wrapped.last_stats
            assert (stats.num_rounds, stats.num_draft_tokens, stats.num_accepted_tokens) == (0, 0, 0)
            assert_no_slot_leak(wrapped)
        return cache[key].clone()

    return run


def _lengths(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"max_new_tokens": MAX_NEW_TOKENS} | kwargs


def _wrap(spec: TinyModelSpec, monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[Any, Recorder]:
    wrapped = sparsespec.wrap(spec.build(), **({"kv_capacity_tokens": KV_CAPACITY} | options))
    return wrapped, Recorder.attach(wrapped, monkeypatch)


def _rows_equal(expected: torch.Tensor, actual: torch.Tensor, what: str) -> None:
    if torch.equal(expected, actual):
        return
    assert expected.shape == actual.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    row, column = (expected != actual).nonzero()[0].tolist()
    raise AssertionError(
        f"{what}: first difference at row {row}, column {column}: {actual[row, column].item()} != "
        f"draft=None's {expected[row, column].item()}\nactual:\n{actual}\nexpected:\n{expected}"
    )


def check_bookkeeping(wrapped: Any, recorder: Recorder, stopped: bool = False) -> None:
    """The call's speculation counters agree with each other, with each request's counters and with the
    verify steps the runner really ran; no KV slot leaked."""
    assert_no_slot_leak(wrapped)
    k = wrapped.spec_config.k
    stats = wrapped.last_stats
    histogram = stats.accepted_histogram
    assert len(histogram) == k + 1
    assert stats.num_rounds == sum(histogram)
    assert stats.num_accepted_tokens == sum(i * count for i, count in enumerate(histogram))
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens <= k * stats.num_rounds
    assert 0 <= stats.mean_accepted <= k
    assert stats.mean_accepted == pytest.approx(stats.num_accepted_tokens / max(1, stats.num_rounds))
    # What the runner did: rounds are the verifies that checked drafts; a verify accepts a prefix of its drafts.
    rounds = [v for v in recorder.verifies if v.drafts]
    assert stats.num_rounds == len(rounds)
    assert stats.num_draft_tokens == sum(len(v.drafts) for v in rounds)
    assert stats.num_accepted_tokens == sum(v.num_accepted for v in rounds)
    for v in recorder.verifies:
        assert len(v.drafts) <= k
        produced = v.first_position + 1 - v.request.num_prompt_tokens  # output tokens before this verify
        assert produced + len(v.drafts) + 1 <= v.request.params.max_new_tokens, "drafted past max_new_tokens"
        assert v.tokens[: v.num_accepted] == v.drafts[: v.num_accepted]
        assert len(v.tokens) == v.num_accepted + 1
        if v.num_accepted < len(v.drafts):
            assert v.tokens[-1] != v.drafts[v.num_accepted], "a draft equal to the target's token was rejected"
    # Per request.
    requests = recorder.requests()
    assert sum(r.spec_stats.num_rounds for r in requests) == stats.num_rounds
    assert sum(r.spec_stats.num_draft_tokens for r in requests) == stats.num_draft_tokens
    assert sum(r.spec_stats.num_accepted_tokens for r in requests) == stats.num_accepted_tokens
    assert stats.generated_tokens == sum(r.num_output_tokens for r in requests)
    for request in requests:
        spec = request.spec_stats
        own = [v for v in rounds if v.request is request]
        assert spec.accepted_per_round == [v.num_accepted for v in own]
        assert spec.context_per_round == [v.first_position for v in own]
        assert spec.num_rounds == len(own) == len(spec.accepted_per_round)
        assert spec.num_draft_tokens == sum(len(v.drafts) for v in own)
        assert spec.num_accepted_tokens == sum(spec.accepted_per_round)
        # The prefill's token, then each verify's accepted drafts and one more; a stop token may cut the last.
        emitted = recorder.emitted(request)
        if stopped:
            assert request.num_output_tokens <= emitted
        else:
            assert request.num_output_tokens == emitted


def check_outputs(wrapped: Any, outputs: Collection[Any], recorder: Recorder) -> None:
    """generate_batch's per-request stats are the engine's per-request counters, and add up to the call's."""
    stats = wrapped.last_stats
    by_id = {r.request_id: r for r in recorder.requests()}
    for output in outputs:
        speculation = output.stats.speculation
        assert speculation == by_id[output.index].spec_stats
        assert output.stats.generated_tokens == len(output.token_ids)
        assert output.stats.mean_accepted == pytest.approx(
            speculation.num_accepted_tokens / max(1, speculation.num_rounds)
        )
        assert 0 <= output.stats.mean_accepted <= wrapped.spec_config.k
    assert sum(o.stats.speculation.num_rounds for o in outputs) == stats.num_rounds
    assert sum(o.stats.speculation.num_draft_tokens for o in outputs) == stats.num_draft_tokens
    assert sum(o.stats.speculation.num_accepted_tokens for o in outputs) == stats.num_accepted_tokens
    assert sum(o.stats.generated_tokens for o in outputs) == stats.generated_tokens


def check_rounds_happened(wrapped: Any, recorder: Recorder) -> None:
    """Drafts were made and verified; every draft step attended to itself and nothing later, each position at
    most once; and where the budget (+ k recent tokens) is below the context, some draft step attended sparsely."""
    stats = wrapped.last_stats
    assert stats.num_rounds > 0 and stats.num_draft_tokens > 0, f"no speculation round ran: {stats}"
    policy = wrapped.engine.policy
    if policy.proposes_tokens or (not policy.sparse_layers and policy.selects_in_attention):
        return  # no forward-free drafts to inspect, or no layer that selects
    assert recorder.draft_calls, "no draft step ran"
    for call in recorder.draft_calls:
        rows = call.positions.reshape(-1, call.positions.shape[-1])
        for row in rows:
            valid = row[row >= 0]  # -1 is padding (a partial page)
            assert int(valid[-1]) == call.position, "a draft step does not attend to itself"
            assert bool((valid.diff() > 0).all()), f"draft positions not sorted and unique: {valid.tolist()}"
    k = wrapped.spec_config.k
    if policy.sparse_layers and any(policy.budget(c.position + 1) + k < c.position + 1 for c in recorder.draft_calls):
        sparse = [
            call for call in recorder.draft_calls if int((call.positions >= 0).sum(dim=-1).max()) < call.position + 1
        ]
        assert sparse, "no draft step attended sparsely: the budget covered every context"


def _self_drafting(policy: str) -> bool:
    return not POLICIES[policy].proposes_tokens


# -- 1. lossless: policies x architectures x draft length and budget -------------------------------------------
MEDIUM = {"min_budget": 48, "sparsity": 0.1}  # sparse on 3 of the 4 prompts, yet many drafts accepted
DRAFTING = [
    pytest.param(policy, k, budget, id=f"{policy}-{label}")
    for policy in POLICY_NAMES
    for k, budget, label in [(4, SPARSE, "k4"), (1, SPARSE, "k1"), (8, SPARSE, "k8"), (4, MEDIUM, "k4-budget48")]
    if budget is SPARSE or _self_drafting(policy)  # token proposers have no attention budget
]


@pytest.mark.parametrize(("policy", "k", "budget"), DRAFTING)
@pytest.mark.parametrize("spec", [GQA, MHA], ids=_ids([GQA, MHA]))
def test_greedy_generate_is_lossless(spec, policy, k, budget, baseline, monkeypatch):
    """Left-padded generate with drafts of length k gives draft=None's tensor token for token; the counters
    add up and sparse rounds really ran (with a middling budget, drafts are also accepted)."""
    expected = baseline(spec, BATCH)
    wrapped, recorder = _wrap(spec, monkeypatch, draft=policy, k=k, **budget)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _rows_equal(expected, actual, f"{spec.id} {policy} k={k}")
    check_bookkeeping(wrapped, recorder)
    check_rounds_happened(wrapped, recorder)
    if budget is MEDIUM:
        histogram = wrapped.last_stats.accepted_histogram
        assert sum(histogram[1:]) > 0, f"no draft was ever accepted: {histogram}"


# The step's draft budget shared by the batch's 4 requests covers every context as a per-request budget would.
STEP_SHARE = SPARSE | {"draft_step_budget": 4 * DENSE["min_budget"]}


@pytest.mark.parametrize("budget", [DENSE, STEP_SHARE], ids=["min_budget", "step_share"])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if _self_drafting(p)])
def test_budget_covering_the_context_accepts_every_draft(policy, budget, baseline, monkeypatch):
    """With a budget larger than every context a self-draft attends to everything, so it is the target's own
    greedy token and every draft is accepted: any slip in the drafts' KV, positions or round bookkeeping
    would show as a rejection. The budget is each request's own, or its share of the step's draft budget."""
    expected = baseline(GQA, BATCH)
    wrapped, recorder = _wrap(GQA, monkeypatch, draft=policy, k=4, **budget)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _rows_equal(expected, actual, policy)
    check_bookkeeping(wrapped, recorder)
    stats = wrapped.last_stats
    assert stats.num_rounds > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats.accepted_histogram
    assert stats.accepted_histogram[0] == 0


def test_the_step_draft_budget_is_shared_by_the_running_requests(monkeypatch):
    """Each step the scheduler gives every draft the running requests' share of ``draft_step_budget``: as the
    batch drains (requests of 4 to 24 new tokens) each remaining request drafts from more of its context. On a
    CPU the default is no step budget (attention there costs what it reads, at any batch size)."""
    from torchspec.scheduler import Scheduler

    seen: list[tuple[int, int]] = []  # (running requests, share) after each schedule
    schedule = Scheduler.schedule

    def spy(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        plan = schedule(self, *args, **kwargs)
        seen.append((len(self.running), self.policy.step_share))
        return plan

    monkeypatch.setattr(Scheduler, "schedule", spy)
    for step_budget in (None, 1000):
        seen.clear()
        options = SPARSE | ({} if step_budget is None else {"draft_step_budget": step_budget})
        engine = sparsespec.wrap(GQA.build(), draft="pillar", k=4, kv_capacity_tokens=KV_CAPACITY, **options).engine
        requests = [
            engine.new_request(i, prompt, SamplingParams(max_new_tokens=n))
            for i, (prompt, n) in enumerate(zip(BATCH.prompts, (4, 8, 16, 24), strict=True))
        ]
        engine.run(requests)
        assert all(r.is_finished for r in requests)
        shares = {4: 0, 3: 0, 2: 0, 1: 0} if step_budget is None else {4: 250, 3: 333, 2: 500, 1: 1000}
        assert set(seen) == set(shares.items())


@pytest.mark.parametrize("policy", ["pillar_recent", "streaming"])
def test_budget_by_misses_weighs_each_request_by_its_misses_and_keeps_the_output(policy, baseline, monkeypatch):
    """With ``budget_by_misses`` each step weighs a running request's draft budget by 1 + its recent misses over
    the batch's mean (at most 3x): the weights follow the misses, average at most 1, and reach the policy's
    budgets; the output is plain greedy decoding's."""
    from torchspec.drafting.base import DraftPolicy
    from torchspec.scheduler import MAX_DRAFT_WEIGHT, Scheduler

    steps: list[list[tuple[float, float]]] = []  # (recent misses, weight) of each running request, per step
    budget_weights: list[float] = []
    schedule, budget = Scheduler.schedule, DraftPolicy.budget

    def spy(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        plan = schedule(self, *args, **kwargs)
        steps.append([(r.spec_stats.recent_misses, r.draft_weight) for r in self.running])
        return plan

    def budget_spy(self: DraftPolicy, context_length: int, weight: float = 1.0) -> int:
        budget_weights.append(weight)
        return budget(self, context_length, weight)

    monkeypatch.setattr(Scheduler, "schedule", spy)
    monkeypatch.setattr(DraftPolicy, "budget", budget_spy)
    expected = baseline(GQA, BATCH)
    options = SPARSE | {"draft_step_budget": 64, "budget_by_misses": True}
    wrapped, recorder = _wrap(GQA, monkeypatch, draft=policy, k=4, **options)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _rows_equal(expected, actual, policy)
    check_bookkeeping(wrapped, recorder)
    assert wrapped.last_stats.num_accepted_tokens < wrapped.last_stats.num_draft_tokens  # some drafts miss
    weighed = [step for step in steps if len({weight for _, weight in step}) > 1]
    assert weighed, "no step weighed its requests differently"
    for step in weighed:
        weights = [weight for _, weight in step]
        assert sum(weights) / len(weights) <= 1 + 1e-9
        assert max(weights) <= MAX_DRAFT_WEIGHT
        for (miss_a, weight_a), (miss_b, weight_b) in itertools.combinations(step, 2):
            assert (miss_a < miss_b) <= (weight_a <= weight_b), step
    assert len(set(budget_weights)) > 1  # the policy's budgets read the weights


def test_budget_by_misses_refuses_query_sketch():
    with pytest.raises(ValueError, match=r"budget_by_misses=True cannot run with draft='query_sketch'"):
        SpecConfig(draft="query_sketch", budget_by_misses=True)


def test_budget_by_misses_is_on_by_default_for_sparse_drafts_on_a_gpu():
    """``None``: on with CUDA for sparse drafts with budgets (W1, three H100s), not for ``query_sketch``, token
    proposers, plain decoding or on a CPU; an explicit setting wins."""
    from torchspec.drafting import POLICIES
    from torchspec.engine import use_budget_by_misses

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    by_name = {name: POLICIES[name] for name in ("pillar_recent", "streaming", "query_sketch", "ngram")}
    assert use_budget_by_misses(None, by_name["pillar_recent"], cuda) is True
    assert use_budget_by_misses(None, by_name["streaming"], cuda) is True
    assert use_budget_by_misses(None, by_name["query_sketch"], cuda) is False
    assert use_budget_by_misses(None, by_name["ngram"], cuda) is False
    assert use_budget_by_misses(None, None, cuda) is False
    assert use_budget_by_misses(None, by_name["pillar_recent"], cpu) is False
    assert use_budget_by_misses(True, by_name["pillar_recent"], cpu) is True
    assert use_budget_by_misses(False, by_name["pillar_recent"], cuda) is False


@pytest.mark.parametrize("max_new_tokens", [1, 2, 6, 7])
@pytest.mark.parametrize("policy", ["pillar", "ngram"])
def test_rounds_are_cut_to_the_tokens_still_allowed(policy, max_new_tokens, baseline, monkeypatch):
    """Near max_new_tokens a round drafts only what can still be emitted (1 or 2 tokens: no round; 6 with k=4:
    the prefill's token and one full round; 7: then a plain step): exact lengths and draft=None's tokens."""
    expected = baseline(GQA, BATCH, max_new_tokens=max_new_tokens)
    wrapped, recorder = _wrap(GQA, monkeypatch, draft=policy, k=4, **DENSE)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=max_new_tokens, do_sample=False)
    _rows_equal(expected, actual, f"{policy} max_new_tokens={max_new_tokens}")
    assert actual.shape[1] == BATCH.width + max_new_tokens
    check_bookkeeping(wrapped, recorder)
    stats = wrapped.last_stats
    if max_new_tokens <= 2:
        assert stats.num_rounds == 0
    elif policy == "pillar":  # 6 and 7 tokens: one round of 4 exact drafts per request (7: then one plain step)
        assert stats.num_accepted_tokens == stats.num_draft_tokens == 4 * len(BATCH.lengths)
        assert sum(not v.drafts for v in recorder.verifies) == (max_new_tokens - 6) * len(BATCH.lengths)


@pytest.mark.parametrize("policy", ["pillar_recent", "streaming", "pillar_quest"])
def test_draft_chain_drafts_a_round_in_one_step(policy, baseline, monkeypatch):
    """With draft chains (the default) every draft request drafts its whole round within one step, its later
    forwards fed the earlier drafts on the device; with ``draft_chain=False`` one draft per step. Both give
    draft=None's tokens and the same rounds, and the chain takes fewer steps."""
    expected = baseline(GQA, BATCH)
    steps, histograms = {}, {}
    for chain in (True, False):
        wrapped, recorder = _wrap(GQA, monkeypatch, draft=policy, k=4, draft_chain=chain, **MEDIUM)
        assert wrapped.engine.draft_chain is chain
        actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        _rows_equal(expected, actual, f"{policy} draft_chain={chain}")
        check_bookkeeping(wrapped, recorder)
        check_rounds_happened(wrapped, recorder)
        if chain:  # a whole round at once, from its start
            assert all(made == 0 and forwards == length for forwards, made, length in recorder.draft_items)
            assert any(forwards > 1 for forwards, _, _ in recorder.draft_items), "no chain had two drafts"
        else:
            assert all(forwards == 1 for forwards, _, _ in recorder.draft_items)
        steps[chain], histograms[chain] = len(recorder.step_tokens), wrapped.last_stats.accepted_histogram
    assert histograms[True] == histograms[False]
    assert steps[True] < steps[False]


def test_draft_chain_runs_whole_rounds_so_requests_never_wait(baseline, monkeypatch):
    """Prompts prefilled 64 tokens a step finish at different steps; with draft chains every step runs each
    decoding request's whole round (its drafts, then its verify), so once every prompt is in, each step holds
    every request still running: none sits a step out to get back in phase. Tokens stay draft=None's."""
    expected = generated_rows(baseline(GQA, BATCH), BATCH)
    wrapped, recorder = _wrap(GQA, monkeypatch, draft="pillar_recent", k=4, max_step_tokens=64, **MEDIUM)
    outputs = wrapped.generate_batch(
        BATCH.prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, progress_bar=False
    ).values()
    assert [o.token_ids for o in outputs] == expected
    check_bookkeeping(wrapped, recorder)
    last_prefill = max(i for i, phases in enumerate(recorder.step_phases) if Phase.PREFILL in phases)
    assert len({len(r) for r in recorder.step_requests[: last_prefill + 1]}) > 1, "prompts finished together"
    assert all(made == 0 and forwards == length for forwards, made, length in recorder.draft_items)
    later = recorder.step_requests[last_prefill + 1 :]
    assert len(later) > 8, "too few steps after the prompts to tell"
    assert all(after <= before for before, after in itertools.pairwise(later)), "a request sat a step out"


def test_adaptive_rounds_mix_plain_steps_and_rounds_and_keep_the_tokens(baseline, monkeypatch):
    """With ``adaptive_rounds`` each step's round length is chosen from measured costs: every batch size first
    times a round, then a plain step, so both run here whatever the CPU's timings choose; tokens stay
    draft=None's and the counters add up."""
    expected = generated_rows(baseline(GQA, BATCH), BATCH)
    wrapped, recorder = _wrap(GQA, monkeypatch, draft="pillar_recent", k=4, adaptive_rounds=True, **MEDIUM)
    policy = wrapped.engine.policy
    learned, on_verifies = [], policy.on_verifies

    def spy_verifies(requests, *args):
        learned.extend(requests)
        on_verifies(requests, *args)

    monkeypatch.setattr(policy, "on_verifies", spy_verifies)
    outputs = wrapped.generate_batch(
        BATCH.prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, progress_bar=False
    ).values()
    assert [o.token_ids for o in outputs] == expected
    check_bookkeeping(wrapped, recorder)
    assert any(v.drafts for v in recorder.verifies), "no round ran"
    assert any(phases == {Phase.VERIFY} for phases in recorder.step_phases), "no plain step ran"
    # Every round's verify teaches PillarAttn; a plain step right after one does not (its pattern is fresh).
    rounds = sum(1 for v in recorder.verifies if v.drafts)
    assert rounds + len(BATCH.lengths) <= len(learned) < len(recorder.verifies) + len(BATCH.lengths)


def test_relearn_rounds_learn_from_every_other_round(baseline, monkeypatch):
    """With ``relearn_rounds=2`` PillarAttn learns from the verify of every other round a request verifies (and
    of any round a plain step would learn from: no pattern yet, or a recent run as long as a budget); the rounds
    between draft from the last pattern and its recent run. Tokens stay draft=None's."""
    expected = generated_rows(baseline(GQA, BATCH), BATCH)
    wrapped, recorder = _wrap(GQA, monkeypatch, draft="pillar_recent", k=4, relearn_rounds=2, **MEDIUM)
    policy = wrapped.engine.policy
    learned, on_verifies = [], policy.on_verifies

    def spy_verifies(requests, *args):
        learned.extend((r.spec_stats.num_rounds, policy.learns_from_plain_step(r)) for r in requests)
        on_verifies(requests, *args)

    monkeypatch.setattr(policy, "on_verifies", spy_verifies)
    outputs = wrapped.generate_batch(
        BATCH.prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, progress_bar=False
    ).values()
    assert [o.token_ids for o in outputs] == expected
    check_bookkeeping(wrapped, recorder)
    rounds = sum(1 for v in recorder.verifies if v.drafts)
    assert all(verified % 2 == 0 or plain for verified, plain in learned)
    assert len(learned) < rounds, "every round learned"


def test_adaptive_rounds_wait_for_the_batch_to_fill(baseline, monkeypatch):
    """While the prompts still pending exceed a step's budget (the batch ramping up), steps decode plainly; the
    first round starts once the rest fits one step. Tokens stay draft=None's."""
    expected = generated_rows(baseline(GQA, BATCH), BATCH)
    wrapped, recorder = _wrap(
        GQA, monkeypatch, draft="pillar_recent", k=4, adaptive_rounds=True, max_step_tokens=16, **MEDIUM
    )
    outputs = wrapped.generate_batch(
        BATCH.prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, progress_bar=False
    ).values()
    assert [o.token_ids for o in outputs] == expected
    check_bookkeeping(wrapped, recorder)
    pending, first_round = sum(BATCH.lengths), None
    for step, phases in enumerate(recorder.step_phases):
        if Phase.DRAFT in phases:
            first_round = step
            break
        pending -= recorder.step_prefill_tokens[step]
    assert first_round is not None and first_round > 1, "no plain steps while the prompts filled in"
    assert pending + recorder.step_prefill_tokens[first_round - 1] > 16 >= pending


def test_adaptive_rounds_are_refused_without_draft_chains(tiny_model):
    with pytest.raises(ValueError, match="adaptive_rounds=True needs draft chains"):
        sparsespec.wrap(tiny_model, draft=None, adaptive_rounds=True)


def test_whole_rounds_keep_every_forward_within_the_step_token_budget(baseline, monkeypatch):
    """A round verified in the step that drafted it counts its verify's tokens (1 + drafts) against
    ``max_step_tokens``: the step's verify forward, its largest, holds at most the budget (here 12 tokens for
    4 requests of k=4 rounds, all decoding together after short prompts: at most two rounds per step), and
    tokens stay draft=None's."""
    batch = MixedBatch((9, 10, 11, 12))
    expected = generated_rows(baseline(GQA, batch), batch)
    wrapped, recorder = _wrap(GQA, monkeypatch, draft="pillar_recent", k=4, max_step_tokens=12, **DENSE)
    runner, sizes = wrapped.engine.runner, []
    forward = runner._forward

    def spy_forward(plan, input_ids, *args):
        sizes.append(input_ids.shape[1])
        return forward(plan, input_ids, *args)

    monkeypatch.setattr(runner, "_forward", spy_forward)
    outputs = wrapped.generate_batch(
        batch.prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, progress_bar=False
    ).values()
    assert [o.token_ids for o in outputs] == expected
    check_bookkeeping(wrapped, recorder)
    assert any(size > 5 for size in sizes), "no verify forward held two rounds"
    assert max(sizes) <= 12, max(sizes)


def test_draft_chain_is_refused_for_a_policy_that_decides_between_drafts(tiny_model):
    """sparsespec_l ends a round by each draft's entropy, read on the host after every draft step: it runs one
    draft per step by default, and ``draft_chain=True`` names why it cannot."""
    assert not sparsespec.wrap(tiny_model, draft="sparsespec_l").engine.draft_chain
    with pytest.raises(ValueError, match=r"draft_chain=True cannot run with draft='sparsespec_l': it decides after"):
        sparsespec.wrap(tiny_model, draft="sparsespec_l", draft_chain=True)


# -- schedules: chunked prefill, batch limit, KV capacity, with generate_batch ---------------------------------
LARGEST_NEED = max(BATCH.lengths) + MAX_NEW_TOKENS + 4  # prompt + max_new_tokens + k draft slots
TOTAL_NEED = sum(BATCH.lengths) + len(BATCH.lengths) * (MAX_NEW_TOKENS + 4)
SMALL_POOL = 200
SCHEDULES = [
    pytest.param({"max_step_tokens": 8}, id="chunk8"),
    pytest.param({"max_batch_size": 2}, id="batch2"),
    pytest.param({"kv_capacity_tokens": SMALL_POOL}, id=f"kv{SMALL_POOL}"),
]


@pytest.mark.parametrize("options", SCHEDULES)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_generate_batch_schedules_are_lossless(policy, options, baseline, monkeypatch):
    """generate_batch over 4 unpadded prompts, with prefill chunks sharing steps with drafts and verifies, only
    2 requests at a time, or a pool too small for the batch's reservations (prompt + max_new_tokens + k): each
    request's tokens are draft=None's, per-request stats add up, and the pool is reusable."""
    assert LARGEST_NEED <= SMALL_POOL < TOTAL_NEED
    spec = MHA
    expected = generated_rows(baseline(spec, BATCH), BATCH)
    wrapped, recorder = _wrap(spec, monkeypatch, draft=policy, k=4, **MEDIUM, **options)
    for call in range(2 if "kv_capacity_tokens" in options else 1):  # a second call reuses slots and stale KV
        recorder.reset()
        outputs = wrapped.generate_batch(
            BATCH.prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, progress_bar=False
        ).values()
        assert [o.token_ids for o in outputs] == expected, f"call {call}"
        assert [o.finish_reason for o in outputs] == ["length"] * len(expected)
        check_bookkeeping(wrapped, recorder)
        check_outputs(wrapped, outputs, recorder)
        check_rounds_happened(wrapped, recorder)
    if "max_step_tokens" in options:
        assert max(recorder.step_tokens) <= options["max_step_tokens"]
        assert recorder.mixed_steps > 0, "no step mixed a prompt chunk with a draft or verify"
    if "max_batch_size" in options:
        assert max(map(len, recorder.step_requests)) == options["max_batch_size"]
    if "kv_capacity_tokens" in options:
        assert wrapped.engine.pool.num_slots == SMALL_POOL
        assert max(map(len, recorder.step_requests)) < len(BATCH.lengths), "the pool was not a limit"


# -- sliding windows -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("spec", SLIDING_SPECS, ids=_ids(SLIDING_SPECS))
def test_sliding_window_models_are_lossless(spec, policy, baseline, monkeypatch):
    """Windowed layers keep reading their window in draft steps, full-attention layers draft sparsely (a
    Mistral model has a window on every layer, so there are none): output is draft=None's."""
    expected = baseline(spec, BATCH)
    wrapped, recorder = _wrap(spec, monkeypatch, draft=policy, k=4, **SPARSE)
    windows = [layer.sliding_window for layer in wrapped.layers]
    assert any(w is not None for w in windows)
    assert wrapped.engine.policy.sparse_layers == [i for i, w in enumerate(windows) if w is None]
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _rows_equal(expected, actual, f"{spec.id} {policy}")
    check_bookkeeping(wrapped, recorder)
    check_rounds_happened(wrapped, recorder)
    if _self_drafting(policy) and not wrapped.engine.policy.sparse_layers:
        stats = wrapped.last_stats  # no layer drafts sparsely: drafts are exact
        assert stats.num_accepted_tokens == stats.num_draft_tokens, stats.accepted_histogram


# -- stop tokens ---------------------------------------------------------------------------------------------
def _eos_on_accepted_draft(recorder: Recorder, batch: Batch) -> int:
    """A token that some request first generates as an accepted draft, so with it as EOS that request stops in
    the middle of a round, dropping the verified tokens after it (preferring the most dropped)."""
    prompts = batch.prompts
    best = None
    for v in recorder.verifies:
        output = v.request.token_ids[len(prompts[v.request.request_id]) :]
        start = v.first_position + 1 - len(prompts[v.request.request_id])  # output index of the first draft
        for j, token in enumerate(v.drafts[: v.num_accepted]):
            if token != PAD_TOKEN_ID and token not in output[: start + j]:
                score = (v.num_accepted - j, -start)  # most accepted drafts dropped, then earliest
                best = max(best or (score, token), (score, token))
    assert best is not None, "no accepted draft is a first occurrence in its output; pick another seed"
    return best[1]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_eos_on_an_accepted_draft_ends_the_row_mid_round(policy, baseline, monkeypatch):
    """A request whose EOS arrives as an accepted draft (not the verify's own token) stops right there: the
    verified tokens after it are dropped, other rows go on, the output is draft=None's with that EOS. Self-drafts
    use a budget covering the context here, so that their drafts are accepted."""
    spec = GQA
    options = {"draft": policy, "k": 4} | (DENSE if _self_drafting(policy) else {})
    wrapped, recorder = _wrap(spec, monkeypatch, **options)
    wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    eos = _eos_on_accepted_draft(recorder, BATCH)
    expected = baseline(spec, BATCH, eos_token_id=eos)
    rows = generated_rows(expected, BATCH, [eos])
    assert any(row[-1] == eos for row in rows)
    recorder.reset()
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos)
    _rows_equal(expected, actual, f"{policy} eos={eos}")
    check_bookkeeping(wrapped, recorder, stopped=True)
    check_rounds_happened(wrapped, recorder)
    mid_round = [
        v
        for v in recorder.verifies
        if eos in v.tokens[: v.num_accepted] and v.request.token_ids[-1] == eos and v.request.finish_reason == "stop"
    ]
    assert mid_round, "no request stopped on an accepted draft"
    for v in mid_round:
        assert v.request.output_ids.count(eos) == 1
    if _self_drafting(policy):
        assert any(v.tokens.index(eos) < v.num_accepted - 1 for v in mid_round), "no accepted draft was dropped"


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_min_new_tokens_holds_back_eos_in_drafts_and_verifies(policy, baseline, monkeypatch):
    """With min_new_tokens, an EOS that greedy decoding would produce early is suppressed in draft steps and
    verifies alike (no draft of it is accepted that early), exactly as in draft=None."""
    spec, min_new = GQA, 12
    rows = generated_rows(baseline(spec, BATCH), BATCH)
    early = [t for row in rows for t in row[1:8] if t != PAD_TOKEN_ID]
    eos = max(set(early), key=early.count)  # a token some row generates early
    expected = baseline(spec, BATCH, eos_token_id=eos, min_new_tokens=min_new)
    assert not torch.equal(expected, baseline(spec, BATCH, eos_token_id=eos)), "min_new_tokens changed nothing"
    wrapped, recorder = _wrap(spec, monkeypatch, draft=policy, k=4, **MEDIUM)
    actual = wrapped.generate(
        **BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=min_new, do_sample=False, eos_token_id=eos
    )
    _rows_equal(expected, actual, f"{policy} eos={eos}")
    check_bookkeeping(wrapped, recorder, stopped=True)
    check_rounds_happened(wrapped, recorder)
    for row in generated_rows(actual, BATCH, [eos]):
        assert eos not in row[:min_new]
    for v in recorder.verifies:
        produced = v.first_position + 1 - v.request.num_prompt_tokens
        too_early = v.drafts[: max(0, min_new - produced)]
        assert eos not in too_early[: v.num_accepted], "an EOS draft before min_new_tokens was accepted"


# -- draft=None ----------------------------------------------------------------------------------------------
def test_no_draft_has_zero_speculation_counters(monkeypatch):
    """Without a draft policy nothing is drafted: every counter, call-wide and per request, is zero."""
    wrapped, recorder = _wrap(GQA, monkeypatch, draft=None)
    outputs = wrapped.generate_batch(BATCH.prompts, max_new_tokens=MAX_NEW_TOKENS, progress_bar=False).values()
    stats = wrapped.last_stats
    assert (stats.num_rounds, stats.num_draft_tokens, stats.num_accepted_tokens, stats.mean_accepted) == (0, 0, 0, 0)
    assert sum(stats.accepted_histogram) == 0
    for output in outputs:
        speculation = output.stats.speculation
        assert (speculation.num_rounds, speculation.num_draft_tokens, speculation.num_accepted_tokens) == (0, 0, 0)
        assert speculation.accepted_per_round == [] and speculation.context_per_round == []
        assert output.stats.mean_accepted == 0
    assert all(not v.drafts for v in recorder.verifies)
    check_bookkeeping(wrapped, recorder)


# -- PillarAttn: the pattern a verify leaves and the positions drafts read --------------------------------------
@dataclass
class PillarVerify:
    request_id: int
    mass: list[torch.Tensor]  # per full-attention layer, [num_kv_heads, context]
    first_query: int
    pattern: torch.Tensor
    recent_start: int


@pytest.mark.parametrize("spec", [GQA, SLIDING_SPECS[0]], ids=_ids([GQA, SLIDING_SPECS[0]]))
def test_pillar_pattern_is_top_k_of_the_verify_mass(spec, monkeypatch):
    """After each verify (and last prompt chunk) the pattern is, per full-attention layer and KV head, the K
    older positions with the most verify mass, K = budget - (k + 1) for a verify of k drafts (all older
    positions when the budget covers them), sorted; each draft step reads the pattern plus every position from
    that verify's first query to its own, at most budget + k positions."""
    k = 4
    wrapped = sparsespec.wrap(spec.build(), kv_capacity_tokens=KV_CAPACITY, draft="pillar", k=k, **SPARSE)
    policy = wrapped.engine.policy
    full_layers = [layer.layer_idx for layer in wrapped.layers if layer.sliding_window is None]
    num_kv_heads = wrapped.layers[0].num_kv_heads
    assert policy.sparse_layers == full_layers
    events: list[Any] = []
    on_verifies, draft_positions = policy.on_verifies, policy.draft_positions

    def spy_verifies(
        requests: list[Request], mass: torch.Tensor, rows: list[int], contexts: list[int], first_queries: list[int]
    ) -> None:
        on_verifies(requests, mass, rows, contexts, first_queries)  # one batched Top-K for the step's verifies
        for request, row, context, first_query in zip(requests, rows, contexts, first_queries, strict=True):
            state, request_mass = request.round, list(mass[..., row, :context])
            events.append(
                PillarVerify(request.request_id, request_mass, first_query, state.pattern, state.recent_start)
            )

    def spy_positions(request: Request, position: int) -> tuple[torch.Tensor, int]:
        chosen = draft_positions(request, position)
        positions = attended_positions(chosen, position)
        events.append(DraftCall(request.request_id, position, positions, request.round.pattern, 0))
        return chosen

    monkeypatch.setattr(policy, "on_verifies", spy_verifies)
    monkeypatch.setattr(policy, "draft_positions", spy_positions)
    wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert_no_slot_leak(wrapped)

    latest: dict[int, PillarVerify] = {}
    full_verifies = selected = drafts = 0
    for event in events:
        if isinstance(event, DraftCall):
            verify = latest[event.request_id]
            budget = policy.budget(verify.mass[0].shape[-1])
            pattern, recent = verify.pattern, torch.arange(verify.first_query, event.position + 1)
            expected = torch.cat([pattern, recent if pattern.dim() == 1 else recent.expand(*pattern.shape[:2], -1)], -1)
            assert torch.equal(event.positions, expected)
            assert event.positions.shape[-1] <= budget + k
            drafts += 1
            continue
        latest[event.request_id] = event
        mass, first_query, pattern = event.mass, event.first_query, event.pattern
        context = mass[0].shape[-1]
        num_queries = context - first_query
        assert 1 <= num_queries <= k + 1
        assert event.recent_start == first_query
        assert len(mass) == len(full_layers)
        for layer_mass in mass:
            assert layer_mass.shape == (num_kv_heads, context)
            # Weights relative to each scored row's sink or newest token (tested in the attention's own tests).
            assert torch.isfinite(layer_mass.float()).all() and (layer_mass[:, 0] > 0).all()
        budget = policy.budget(context)
        size = min(first_query, max(0, budget - num_queries))
        if size == first_query:
            assert torch.equal(pattern, torch.arange(first_query))
            continue
        assert pattern.shape == (len(full_layers), num_kv_heads, size)
        if num_queries == k + 1:
            assert size == budget - (k + 1)
            full_verifies += 1
        assert bool((pattern < first_query).all()) and bool((pattern >= 0).all())
        assert bool((pattern.diff(dim=-1) > 0).all()), "pattern not sorted (or repeats a position)"
        for i, layer_mass in enumerate(mass):
            for head in range(num_kv_heads):
                older = layer_mass[head, :first_query]
                chosen = torch.zeros(first_query, dtype=torch.bool)
                chosen[pattern[i, head]] = True
                if size:
                    assert older[chosen].min() >= older[~chosen].max(), "Top-K skipped a heavier position"
                    selected += 1
    assert full_verifies > 0 and selected > 0 and drafts > 0, (full_verifies, selected, drafts)


def _layer_specs(windows: Sequence[int | None], num_kv_heads: int = 2) -> list[LayerSpec]:
    return [
        LayerSpec(layer_idx=i, num_heads=4, num_kv_heads=num_kv_heads, head_dim=16, scaling=0.25, sliding_window=w)
        for i, w in enumerate(windows)
    ]


def _pillar(**options: Any) -> PillarPolicy:
    """PillarAttn over full / sliding / full layers with 2 KV heads."""
    return PillarPolicy(SpecConfig(draft="pillar", **options), _layer_specs([None, 8, None]))


def _request(length: int = 100) -> Request:
    return Request(
        request_id=0, prompt_ids=list(range(FIRST_PROMPT_TOKEN, FIRST_PROMPT_TOKEN + length)), params=SamplingParams()
    )


def test_pillar_learns_from_a_plain_step_only_once_its_recent_run_fills_the_budget():
    """A plain step (a verify without drafts) hands its attention to PillarAttn when there is no pattern yet,
    or when the run every draft reads on top of the pattern has grown to a whole budget (11 positions at a
    ~105-position context); a round's verify always does (the scheduler's part)."""
    policy = _pillar(k=4, min_budget=8, sparsity=0.1)
    request = _request()
    assert policy.learns_from_plain_step(request), "no pattern yet"
    policy.on_verify(request, torch.rand(len(policy.sparse_layers), 2, 100), 95)
    request.num_computed_tokens = 100
    assert request.round.recent_start == 95 and not policy.learns_from_plain_step(request)
    request.num_computed_tokens = 104  # a run of 9 positions, budget 11 at 105 positions
    assert not policy.learns_from_plain_step(request)
    request.num_computed_tokens = 106  # 11 positions, budget 11
    assert policy.learns_from_plain_step(request)


# Per (sparse layer, KV head): five older positions given the most mass.
PLANTED = {
    (0, 0): [0, 17, 42, 60, 94],
    (0, 1): [5, 6, 7, 8, 9],
    (1, 0): [90, 91, 92, 93, 94],
    (1, 1): [1, 30, 31, 70, 88],
}


def test_pillar_top_k_of_a_synthetic_mass():
    """on_verify keeps, per sparse layer and KV head, exactly the K = budget - (k + 1) older positions of most
    mass, sorted; the verify's own positions never compete (they are read anyway); the draft at position p
    then reads those plus first_query..p."""
    policy = _pillar(k=4, min_budget=8, sparsity=0.1)
    assert policy.sparse_layers == [0, 2]
    request = _request()
    assert not policy.ready(request), "PillarAttn drafts before any verify told it where to look"
    context, first_query = 100, 95  # a verify of 4 drafts: queries at 95..99
    generator = torch.Generator().manual_seed(0)
    mass = [torch.rand(2, context, generator=generator) for _ in policy.sparse_layers]
    for (layer, head), positions in PLANTED.items():
        mass[layer][head, positions] += 5.0
    for layer_mass in mass:
        layer_mass[:, first_query:] += 100.0  # heaviest of all, but not candidates
    policy.on_verify(request, torch.stack(mass), first_query)
    assert policy.budget(context) == 10  # ceil(0.1 * 100)
    expected = torch.tensor([[PLANTED[layer, head] for head in range(2)] for layer in range(2)])
    assert torch.equal(request.round.pattern, expected)
    assert request.round.recent_start == first_query
    assert policy.ready(request)
    positions = attended_positions(policy.draft_positions(request, 97), 97)
    assert torch.equal(positions, torch.cat([expected, torch.tensor([95, 96, 97]).expand(2, 2, -1)], dim=-1))


def _latest_ngram_continuation(tokens: list[int], max_tokens: int) -> list[int]:
    """N-gram lookup written out: the latest earlier occurrence of the last 3, 2 or 1 tokens, and what followed."""
    for n in range(min(3, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + max_tokens]
    return []


def test_ngram_proposes_the_latest_earlier_continuation_as_the_request_grows():
    """The n-gram policy searches a request's tokens kept as a str and extended each round: its proposals equal
    a plain scan's at every length, with token ids among the code points a str holds only unpaired (surrogates)
    and after the history shrank."""
    policy = POLICIES["ngram"](SpecConfig(draft="ngram"), _layer_specs([None]))
    generator = torch.Generator().manual_seed(0)
    alphabet = [1, 2, 3, 0xD7FF, 0xD800, 0xDFFF, 0xE000, 151_935]
    request = _request(1)
    proposed = 0
    for _ in range(300):
        request.token_ids.append(alphabet[int(torch.randint(len(alphabet), (1,), generator=generator))])
        expected = _latest_ngram_continuation(request.token_ids, 4)
        assert policy.propose(request, 4) == expected, request.token_ids
        proposed += bool(expected)
    assert proposed > 250, "the tokens repeat: most rounds find an earlier n-gram"
    del request.token_ids[-50:]
    assert policy.propose(request, 4) == _latest_ngram_continuation(request.token_ids, 4)


def test_pillar_budget_covering_older_positions_keeps_them_all():
    """When the budget holds every older position, the pattern is all of them (one list shared by layers and
    heads) and a draft reads the whole context."""
    policy = _pillar(k=4, min_budget=200)
    request = _request()
    mass = [torch.rand(2, 100) for _ in policy.sparse_layers]
    policy.on_verify(request, torch.stack(mass), 95)
    assert torch.equal(request.round.pattern, torch.arange(95))
    assert torch.equal(attended_positions(policy.draft_positions(request, 98), 98), torch.arange(99))


def test_pillar_budget_below_the_verify_queries_keeps_only_recent_positions():
    """A budget smaller than the verify's own k + 1 queries leaves no older position: drafts read only what
    was written since the verify (never a negative Top-K)."""
    policy = _pillar(k=8, min_budget=8, sparsity=0.01)
    request = _request()
    policy.on_verify(request, torch.rand(len(policy.sparse_layers), 2, 100), 91)
    assert request.round.pattern.shape == (2, 2, 0)
    assert torch.equal(
        attended_positions(policy.draft_positions(request, 93), 93), torch.arange(91, 94).expand(2, 2, -1)
    )


def test_default_draft_is_pillar_recent_with_window_and_successors():
    """The default draft is PillarAttn with a 64-token recent window and 4 successors per pick (the best real
    draft measured, docs/acceptance.md); explicit values override its defaults; `pillar` stays the paper's."""
    assert SpecConfig().draft == "pillar_recent"
    layers = _layer_specs([None, 8, None])
    default = POLICIES["pillar_recent"](SpecConfig(), layers)
    assert (default.window, default.successors) == (64, 4)
    tuned = POLICIES["pillar_recent"](SpecConfig(recent_window=16, successors=1), layers)
    assert (tuned.window, tuned.successors) == (16, 1)
    paper = _pillar()
    assert (paper.window, paper.successors) == (0, 0)


def test_pillar_recent_pattern_within_budget():
    """Budget 128 at context 1000: the 64-token window and the k + 1 verify queries are read anyway, the rest
    (128 - 64 - 5 = 59) goes to Top-K picks with their 4 successors: 11 picks of 5 positions, each pick one of
    the most-attended positions; a small budget shrinks the window to half of it instead of exceeding it."""
    policy = POLICIES["pillar_recent"](SpecConfig(k=4), _layer_specs([None, 8, None]))
    request = _request(1000)
    mass = torch.rand(2, 2, 1000, generator=torch.Generator().manual_seed(0))
    mass[:, :, 995:] += 10.0  # the verify's own queries: never candidates
    policy.on_verify(request, mass, 995)
    assert request.round.recent_start == 995 - 64
    pattern = request.round.pattern
    assert pattern.shape == (2, 2, 55)
    top = mass[..., :931].topk(11, dim=-1).indices
    for layer in range(2):
        for head in range(2):
            expected = {p + j for p in top[layer, head].tolist() for j in range(5) if p + j < 931}
            row = pattern[layer, head]
            assert set(row[row >= 0].tolist()) == expected
    assert attended_positions(policy.draft_positions(request, 996), 996).shape[-1] <= 128 + 1
    small = POLICIES["pillar_recent"](SpecConfig(k=4, min_budget=32, sparsity=0.01), _layer_specs([None]))
    request = _request(300)
    small.on_verify(request, torch.rand(1, 2, 300), 295)
    assert request.round.recent_start == 295 - 16  # the window shrank to half the budget
    assert attended_positions(small.draft_positions(request, 295), 295).shape[-1] <= 32


def test_head_budgets_share_the_picks_by_attention_mass():
    """head_budgets=True: a layer's picks (count per head x heads) go to the largest masses over all its heads, so
    a head with two dominant positions keeps just those and a diffuse head gets the rest; rows are padded with
    -1 to one width, and a draft still reads at most the budget's worth of positions over the heads."""
    policy = PillarPolicy(SpecConfig(draft="pillar", k=4, min_budget=16, head_budgets=True), _layer_specs([None]))
    request = _request(100)
    mass = torch.full((1, 2, 100), 1e-4)
    mass[0, 0, [10, 20]] = 0.4  # head 0: concentrated on two positions
    mass[0, 1, 30:60] = torch.linspace(0.01, 0.02, 30)  # head 1: diffuse
    policy.on_verify(request, mass, 95)  # budget 16 - 5 verify queries = 11 picks per head, 22 per layer
    pattern = request.round.pattern
    head0, head1 = pattern[0, 0][pattern[0, 0] >= 0].tolist(), pattern[0, 1][pattern[0, 1] >= 0].tolist()
    assert head0 == [10, 20] and head1 == list(range(40, 60))
    assert pattern.shape == (1, 2, 20) and (pattern[0, 0] == -1).sum() == 18


@pytest.mark.parametrize("spec", [GQA, MHA], ids=_ids([GQA, MHA]))
def test_head_budgets_are_lossless(spec, baseline, monkeypatch):
    """Uneven per-head lists (padded with -1) through the engine: the same tokens as plain decoding."""
    expected = baseline(spec, BATCH)
    wrapped, recorder = _wrap(spec, monkeypatch, draft="pillar_recent", k=4, head_budgets=True, **SPARSE)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _rows_equal(expected, actual, f"{spec.id} head budgets")
    check_rounds_happened(wrapped, recorder)


# -- PillarQuest: half verify Top-K, half Quest pages of the round's first draft query --------------------------
def test_pillar_quest_pages_come_from_the_first_draft_query_of_the_round():
    """The verify Top-K takes half of the older budget; the round's first draft query then adds the whole Quest
    pages of largest bound that fit the rest (counting only positions not already taken), per layer; later
    drafts of the round reuse that choice even with another query, and the next round chooses afresh. Rows are
    sorted, without repeats, -1-padded to one length, within budget, and end with the recent positions."""
    policy = PillarQuestPolicy(
        SpecConfig(draft="pillar_quest", k=4, num_sinks=2, recent_window=3, min_budget=72, sparsity=0.01),
        _layer_specs([None, 8, None]),
    )
    request = _request(104)
    context, first_query = 104, 99  # queries 99..103; the recent window 96..98; older positions 0..95
    # Older budget 72 - 8 - 2 sinks = 62: the verify Top-K takes 31 per head (2..31 and one planted pick).
    planted = {0: [*range(2, 32), 50], 1: [*range(2, 32), 70]}
    mass = [torch.rand(2, context, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for layer_mass in mass:
        for head, picks in planted.items():
            layer_mass[head, picks] += 5.0
        layer_mass[:, 96:] += 100.0  # recent: read anyway, never candidates
    policy.on_verify(request, torch.stack(mass), first_query)
    verify_pattern = torch.tensor([[[0, 1, *planted[head]] for head in range(2)]] * 2)
    assert torch.equal(request.round.pattern, verify_pattern)
    assert request.round.recent_start == 96
    # Page 3 (48..63) has the largest bound for queries along dimension 0, page 5 (80..95) along dimension 1.
    keys = 0.01 * torch.randn(110, 2, 16, generator=torch.Generator().manual_seed(2))
    keys[48:64, :, 0] = 5.0
    keys[80:96, :, 1] = 5.0
    first, other = torch.zeros(4, 16), torch.zeros(4, 16)
    first[:, 0] = other[:, 1] = 10.0

    def expected(position: int, pages: Sequence[range]) -> torch.Tensor:
        rows = [sorted({0, 1, *planted[head], *(p for page in pages for p in page)}) for head in range(2)]
        width = max(map(len, rows))
        return torch.tensor([[-1] * (width - len(row)) + row + list(range(96, position + 1)) for row in rows])

    def select(position: int, layer: int, query: torch.Tensor) -> torch.Tensor:
        positions = policy.select_positions(request, position, layer, query, keys[: position + 1], 0.25)
        for row in positions:
            valid = row[row >= 0]
            assert bool((valid.diff() > 0).all()) and int(valid[-1]) == position
            assert len(valid) <= policy.budget(position + 1)
        return positions

    # Room for Quest: 72 - 9 recent - 33 taken = 30, so one page (head 0: 15 new positions, 50 is taken).
    assert torch.equal(select(104, 0, first), expected(104, [range(48, 64)]))
    assert torch.equal(select(104, 2, other), expected(104, [range(80, 96)]))  # per layer, its own query
    assert torch.equal(select(105, 0, other), expected(105, [range(48, 64)]))  # reused by the next draft
    policy.on_verify(request, torch.stack(mass), first_query)  # a new round
    assert request.round.selections == {}
    assert torch.equal(select(104, 0, other), expected(104, [range(80, 96)]))


# -- Query sketch: every draft's positions from its own query, scored on the int4 key sketch, on the device -------
def _sketch_policy(**options: Any) -> Any:
    spec = SpecConfig(draft="query_sketch", k=4, **({"num_sinks": 0, "recent_window": 1} | options))
    return POLICIES["query_sketch"](spec, _layer_specs([None, 8, None]))


def _sketch_choose(
    policy: Any, request: Request, position: int, first: bool, query: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """The positions a query_sketch draft at ``position`` of ``request`` reads, alone in its forward (query
    ``[Hkv x G, D]``), over ``keys`` ``[positions, Hkv, D]`` in slots 0, 1, ... of slot-table row 1 (row 0: another
    request's), one ``[Hkv, n]`` row a head, in list order."""
    table = torch.stack([torch.full((keys.shape[0],), 7), torch.arange(keys.shape[0])])
    codes = torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2] // 2, dtype=torch.uint8)
    scales = torch.zeros(keys.shape[0], keys.shape[1])
    reference.store_key_sketch(keys, torch.arange(keys.shape[0]), codes, scales)
    start = request.round.recent_start
    widths = policy.widths(keys.shape[0], position + 1 - start, first)
    as_tensor = lambda *values: torch.tensor(values)  # noqa: E731
    choice = DraftChoice(
        table=table,
        rows=as_tensor(1),
        positions=as_tensor(position),
        recent_start=as_tensor(start),
        first=as_tensor(first),
        floor=as_tensor(policy.config.min_budget),
        widths=widths,
        choose=lambda *_: None,
        state=policy.prepare(2, widths, torch.device("cpu")),
    )
    view = policy.choose_lists(choice, 0, query[None], codes, scales, 0.25, {})
    return view.kv_indices[:, : int(view.kv_ends[0])]


def test_query_sketch_reads_sinks_recent_positions_and_its_querys_heaviest():
    """After a verify a draft reads the sinks, the window before the verify and everything since, and within the
    rest of the budget the positions of most sketched attention mass for its own query, per KV head; the next
    verify moves the window."""
    policy = _sketch_policy(num_sinks=2, recent_window=3, min_budget=24, sparsity=0.01, sketch_shortlist=0)
    request = _request(104)
    policy.on_verifies([request], None, [0], [104], [99])  # queries 99..103, the window 96..98
    assert request.round.recent_start == 96 and not request.round.chose
    keys = 0.01 * torch.randn(110, 2, 16, generator=torch.Generator().manual_seed(2))
    heavy = {0: [10, 40, 41, 77], 1: [5, 6, 60, 90]}
    for head, positions in heavy.items():
        keys[positions, head, 0] = 5.0
    first, other = torch.zeros(4, 16), torch.zeros(4, 16)
    first[:, 0], other[:, 1] = 10.0, 10.0
    # Budget 24 at 105 positions: 9 recent (96..104), 2 sinks, 13 picks; the 4 heavy positions among them.
    chosen = _sketch_choose(policy, request, 104, True, first, keys)
    for head, positions in heavy.items():
        row = chosen[head].tolist()
        assert row[:2] == [0, 1] and row[2:11] == list(range(96, 105)) and len(row) == 24
        assert set(positions) <= set(row[11:]) and len(set(row)) == 24 and max(row[11:]) < 96
    later = _sketch_choose(policy, request, 105, False, other, keys)  # every draft scores its own query
    assert not set(heavy[0]) <= set(later[0].tolist())
    policy.on_verifies([request], None, [0], [109], [105])
    assert request.round.recent_start == 102 and not request.round.chose


def _sketch_picks(**options: Any) -> Callable[[int, bool, str], set[int]]:
    """A query_sketch policy (5 picks at position 100) over keys where position 10 answers query "first" and 20
    answers "other" (each the last choice of the other query): the older positions its draft at a position
    reads, as the round's first choice or a later one."""
    policy = _sketch_policy(min_budget=8, sparsity=0.01, **options)
    request = _request(100)
    policy.on_verifies([request], None, [0], [100], [99])
    keys = torch.zeros(110, 2, 16)
    keys[10, :, 0], keys[20, :, 1] = 5.0, 5.0
    keys[10, :, 1], keys[20, :, 0] = -5.0, -5.0
    queries = {"first": torch.zeros(4, 16), "other": torch.zeros(4, 16)}
    queries["first"][:, 0], queries["other"][:, 1] = 10.0, 10.0

    def picks(position: int, first: bool, query: str) -> set[int]:
        chosen = _sketch_choose(policy, request, position, first, queries[query], keys)
        return set(chosen[0].tolist()) - set(range(request.round.recent_start, position + 1)) - {-1}

    return picks


def test_query_sketch_shortlist_rescores_only_the_first_choices_best():
    """With ``sketch_shortlist=1`` a round's later choices pick among its first choice's picks only: position 20,
    the later query's best, was not among them; a wider shortlist holds it; without one every draft scores all."""
    picks = _sketch_picks(sketch_shortlist=1)
    first = picks(100, True, "first")
    assert 10 in first and 20 not in first and len(first) == 5
    later = picks(101, False, "other")  # one position more since the verify: 4 picks
    assert len(later) == 4 and later < first and 20 not in later
    wider = _sketch_picks(sketch_shortlist=20)  # the shortlist holds every older position
    wider(100, True, "first")
    assert 20 in wider(101, False, "other")
    every = _sketch_picks(sketch_shortlist=0)
    assert 20 in every(101, False, "other") and 10 not in every(101, False, "other")


def test_query_sketch_rescores_a_shortlist_made_at_a_wider_step_share_whole():
    """A round whose steps' shares of the draft budget shrink (a batch filling up between its drafts) rescores
    the shortlist its first choice kept, wider than the later budget's: the candidates' width holds all of it."""
    policy = _sketch_policy(min_budget=8, sparsity=0.01, sketch_shortlist=2)
    policy.step_share = 40
    first = policy.widths(500, 10, True)
    policy.prepare(2, first, torch.device("cpu"))
    policy.step_share = 0
    later = policy.widths(500, 10, False)
    assert later.picks < first.picks and later.candidates >= policy.num_sinks + policy.shortlists.shape[-1]


def test_query_sketch_state_never_outgrows_its_requests_contexts():
    """A drained batch's step share of the draft budget (65,536 positions for one request) exceeds any context: the
    picks stay within the longest request's positions and the shortlists within its candidates (W1 on the H200 tried
    to allocate 22.7 GiB of shortlists: 8 x 32,768 picks a row)."""
    policy = _sketch_policy(sketch_shortlist=8)
    policy.step_share = 1 << 16
    widths = policy.widths(8_400, 80, True)
    assert widths.picks <= 8_400 and widths.candidates == 8_400
    shortlists, _ = policy.prepare(256, widths, torch.device("cpu"))
    assert shortlists.shape[-1] <= widths.candidates + 3  # whole 16-byte rows


@pytest.mark.parametrize(("shortlist", "successors"), [(0, 0), (2, 0), (8, 2)])
def test_query_sketch_with_room_for_picks_is_lossless(shortlist, successors, baseline, monkeypatch):
    """With a 1-token window and no sinks the budget leaves room for picks: output is draft=None's whether every
    draft scores every older position or rescores a shortlist, with successors or not, and drafts read older
    positions that are neither sinks nor in the window."""
    expected = baseline(GQA, BATCH)
    options = {"recent_window": 1, "num_sinks": 0, "sketch_shortlist": shortlist, "successors": successors}
    wrapped, recorder = _wrap(GQA, monkeypatch, draft="query_sketch", k=4, **options, **MEDIUM)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _rows_equal(expected, actual, f"query_sketch shortlist {shortlist}")
    check_bookkeeping(wrapped, recorder)
    check_rounds_happened(wrapped, recorder)
    picked = [
        call
        for call in recorder.draft_calls
        if int((call.positions >= 0).sum(dim=-1).max()) < call.position + 1  # sparse
        and bool(((call.positions >= 0) & (call.positions < call.recent_start)).any())
    ]
    assert picked, "no sparse draft read a picked position"


def test_pillar_quest_with_room_for_pages_is_lossless(baseline, monkeypatch):
    """With a 1-token recent window the budget leaves room for Quest pages (the default 64-token window fills
    the small budgets above): output is draft=None's, and drafts read positions the verify Top-K did not pick."""
    expected = baseline(GQA, BATCH)
    wrapped, recorder = _wrap(GQA, monkeypatch, draft="pillar_quest", k=4, recent_window=1, **MEDIUM)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _rows_equal(expected, actual, "pillar_quest recent_window=1")
    check_bookkeeping(wrapped, recorder)
    check_rounds_happened(wrapped, recorder)
    from_pages = 0
    for call in recorder.draft_calls:
        if call.pattern.dim() == 3:
            older = call.positions[(call.positions >= 0) & (call.positions < call.recent_start)]
            from_pages += int((~torch.isin(older, call.pattern)).sum())
    assert from_pages > 0, "no draft read a Quest page"


# -- 5. bad options ------------------------------------------------------------------------------------------
# test_bad_input.py already covers sparsity 0 and 1.5, k=0, min_budget=0 and an unknown draft name.
BAD_OPTIONS = [
    pytest.param({"k": -1}, r"k must be an integer >= 1, got -1", id="k=-1"),
    pytest.param({"k": 2.5}, r"k must be an integer >= 1, got 2\.5", id="k=2.5"),
    pytest.param({"k": True}, r"k must be an integer >= 1, got True", id="k=True"),
    pytest.param({"k": "4"}, r"k must be an integer >= 1, got '4'", id="k=str"),
    pytest.param({"k": None}, r"k must be an integer >= 1, got None", id="k=None"),
    pytest.param({"sparsity": -0.1}, r"sparsity must be in \(0, 1\], got -0\.1", id="sparsity<0"),
    pytest.param({"sparsity": float("nan")}, r"sparsity must be in \(0, 1\], got nan", id="sparsity=nan"),
    pytest.param({"sparsity": True}, r"sparsity must be in \(0, 1\], got True", id="sparsity=True"),
    pytest.param({"sparsity": "0.1"}, r"sparsity must be in \(0, 1\], got '0\.1'", id="sparsity=str"),
    pytest.param({"sparsity": None}, r"sparsity must be in \(0, 1\], got None", id="sparsity=None"),
    pytest.param({"min_budget": -3}, r"min_budget must be an integer >= 1, got -3", id="min_budget<0"),
    pytest.param({"min_budget": 1.5}, r"min_budget must be an integer >= 1, got 1\.5", id="min_budget=1.5"),
    pytest.param({"min_budget": True}, r"min_budget must be an integer >= 1, got True", id="min_budget=True"),
    pytest.param({"draft": "Pillar"}, r"unknown draft policy 'Pillar'; choose one of \[", id="draft=Pillar"),
    pytest.param({"draft": ""}, r"unknown draft policy ''", id="draft=empty"),
    pytest.param({"draft": 1}, r"unknown draft policy 1", id="draft=1"),
    pytest.param({"draft_chain": "yes"}, r"draft_chain must be None, True or False", id="draft_chain=str"),
    pytest.param({"relearn_rounds": 0}, r"relearn_rounds must be an integer >= 1, got 0", id="relearn_rounds=0"),
    pytest.param({"sketch_shortlist": -2}, r"sketch_shortlist must be an integer >= 0, got -2", id="shortlist<0"),
    pytest.param(
        {"draft_step_budget": -1}, r"draft_step_budget must be None or an integer >= 0, got -1", id="step_budget<0"
    ),
    pytest.param(
        {"draft_step_budget": 2.0}, r"draft_step_budget must be None or an integer >= 0, got 2\.0", id="step_budget=2.0"
    ),
]


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return GQA.build()


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_speculation_option_is_refused(tiny_model, options, message):
    """wrap() (and SpecConfig) refuse a bad k, sparsity, min_budget or draft name with a ValueError naming the
    option, the bad value and what is allowed."""
    with pytest.raises(ValueError, match=message):
        sparsespec.wrap(tiny_model, **options)
    with pytest.raises(ValueError, match=message):
        SpecConfig(**options)


def test_unknown_draft_error_lists_every_policy(tiny_model):
    """The error for an unknown draft name lists every registered policy (and None)."""
    with pytest.raises(ValueError, match="unknown draft policy") as error:
        sparsespec.wrap(tiny_model, draft="nosuch")
    for name in POLICY_NAMES:
        assert repr(name) in str(error.value)
    assert "None" in str(error.value)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_registered_policy_is_available_and_edge_values_are_accepted(tiny_model, policy):
    """Each registered policy is accepted by name, with the smallest k, sparsity 1 and min_budget 1, and the
    engine runs that policy's class."""
    wrapped = sparsespec.wrap(tiny_model, draft=policy, k=1, sparsity=1, min_budget=1, kv_capacity_tokens=64)
    assert policy in DRAFT_POLICIES
    assert type(wrapped.engine.policy) is POLICIES[policy]
    assert wrapped.engine.policy.config.k == 1


# -- 3. the real SmolLM2 on reasoning prompts --------------------------------------------------------------------
SMOLLM2_NEW_TOKENS = 256
SMOLLM2_OPTIONS = {"k": 8, "sparsity": 0.05, "min_budget": 128, "kv_capacity_tokens": 2048}


@pytest.fixture(scope="module")
def smollm2_reasoning(smollm2) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, draft=None's greedy tokens) for two chat-templated reasoning prompts, computed once."""
    model, tokenizer = smollm2
    prompts = [chat_token_ids(tokenizer, text) for text in read_prompts(limit=2)]
    wrapped = sparsespec.wrap(model, draft=None, kv_capacity_tokens=SMOLLM2_OPTIONS["kv_capacity_tokens"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in single_thread (a module fixture runs before it): far faster on a busy CPU
    try:
        outputs = wrapped.generate_batch(
            prompts, max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False, progress_bar=False
        ).values()
    finally:
        torch.set_num_threads(threads)
    assert wrapped.last_stats.num_rounds == 0
    return prompts, [o.token_ids for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["pillar", "streaming", "ngram"])
def test_smollm2_reasoning_is_lossless(smollm2, smollm2_reasoning, policy, monkeypatch):
    """SmolLM2-135M on two reasoning prompts, 256 greedy tokens, k=8 at 5% sparsity (min_budget 128): every
    policy reproduces draft=None token for token, and PillarAttn accepts most of its drafts."""
    model, _ = smollm2
    prompts, expected = smollm2_reasoning
    wrapped = sparsespec.wrap(model, draft=policy, **SMOLLM2_OPTIONS)
    recorder = Recorder.attach(wrapped, monkeypatch)
    outputs = wrapped.generate_batch(
        prompts, max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False, progress_bar=False
    ).values()
    for output, tokens in zip(outputs, expected, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(output.token_ids, tokens, strict=False)) if a != b), None)
        assert output.token_ids == tokens, f"{policy}, prompt {output.index}: first difference at new token {first}"
    check_bookkeeping(wrapped, recorder, stopped=any(o.finish_reason == "stop" for o in outputs))
    check_outputs(wrapped, outputs, recorder)
    check_rounds_happened(wrapped, recorder)
    if policy == "pillar":
        assert wrapped.last_stats.mean_accepted > 4, wrapped.last_stats.summary()


@pytest.mark.parametrize("draft", ["pillar", "pillar_recent", "pillar_quest"])
def test_pillar_batched_verifies_equal_one_by_one(draft):
    """The runner hands a step's verifies to the policy at once (one padded Top-K over their rows of the step's
    mass): every request's pattern and recent start equal what ``on_verify`` alone gives it, across contexts that
    need picks, contexts the budget covers, a chunk boundary of the batched scores, and rows that are all the
    step's verifies (a view) or some of them out of order (a gather)."""
    policy = POLICIES[draft](SpecConfig(draft=draft, k=4, min_budget=16, sparsity=0.05), _layer_specs([None, 8, None]))
    generator = torch.Generator().manual_seed(0)
    contexts = [700, 12, 333, 95, 1500, 64]
    mass = torch.rand(len(policy.sparse_layers), 2, 8, 1600, generator=generator)  # 8 verifies' rows, padded
    first_queries = [context - 5 for context in contexts]
    for rows in (list(range(6)), [7, 0, 3, 5, 1, 4]):
        alone = [_request(context) for context in contexts]
        for request, row, context, first_query in zip(alone, rows, contexts, first_queries, strict=True):
            policy.on_verify(request, mass[..., row, :context], first_query)
        for max_elements in (1 << 26, 2 * 2 * 1500):  # one batch; one request per chunk
            batched = [_request(context) for context in contexts]
            with unittest.mock.patch.object(pillar, "MAX_SCORE_ELEMENTS", max_elements):
                policy.on_verifies(batched, mass, rows, contexts, first_queries)
            for one, many in zip(alone, batched, strict=True):
                assert one.round.recent_start == many.round.recent_start
                assert torch.equal(one.round.pattern, many.round.pattern)
    assert any(request.round.pattern.dim() == 3 for request in alone), "no context needed picks"
    assert any(request.round.pattern.dim() == 1 for request in alone), "no context was covered by the budget"


def test_successors_expand_ascending_picks_without_a_sort():
    """Each pick brings the positions after it; one a lower pick brought already, one at or past the limit and the
    successors of -1 padding become -1; the rest stay ascending and hold the same set a sort would give."""
    picks = torch.tensor([[[-1, -1, 3, 5, 20]], [[0, 1, 2, 9, 11]]])  # [requests, heads, picks]: ascending after -1s
    limit = torch.tensor([22, 12])[:, None, None]
    expanded = pillar.expand_successors(picks, 3, limit)
    assert expanded.tolist() == [
        [[-1, -1, -1, -1, -1, -1, 3, 4, 5, -1, 6, 7, 20, 21, -1]],
        [[0, 1, 2, -1, -1, 3, -1, -1, 4, 9, 10, 11, -1, -1, -1]],
    ]
    for row, source, cap in zip(expanded.flatten(0, 1), picks.flatten(0, 1), (22, 12), strict=True):
        kept = row[row >= 0].tolist()
        assert kept == sorted(set(kept))
        assert set(kept) == {p + j for p in source.tolist() if p >= 0 for j in range(3) if p + j < cap}
    assert pillar.expand_successors(picks, 1, 4).tolist() == picks.tolist()
