"""Delayed verification: each step is launched before the last one is read back.

The engine then plans step N + 1 from what the host knows while step N runs: a decode is fed step N's token on
the device, a prompt chunk is followed by the next one, and stop conditions apply one step late (the token made
past a stop is discarded). With speculation a request's next round waits for its last one to be read back, so
the decoding requests alternate in two halves. Greedy output must equal the synchronous loop (and, with every
draft policy, draft=None) token for token, with EOS, min and max lengths landing anywhere (mid-round too),
prompts prefilled in several chunks, requests queueing for a small pool, and CUDA graphs' padded path; every KV
slot must be free at the end. The sampled cases are in test_speculative_sampling.py (chi-square against the
exact distribution).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.torchspec.conftest import Batch, assert_no_slot_leak, generated_rows, tiny_spec
from torchspec import sparsespec
from torchspec.drafting import POLICIES
from torchspec.request import SamplingParams
from torchspec.runner import LaunchedStep
from torchspec.scheduler import Scheduler
from torchspec.step import Phase, StepPlan

SPECS = [tiny_spec("llama", 2), tiny_spec("qwen3", 4)]
BATCH = Batch((40, 77, 9, 150, 101, 23), seed=3)
MAX_NEW_TOKENS = 24
LOOPS = {
    "graphs": {"cuda_graphs": True},
    "chunked-prefill": {"max_step_tokens": 32},  # prompts take several steps, next to decodes
    "small-pool": {"kv_capacity_tokens": 200, "max_batch_size": 3},  # requests queue and reuse slots
}


def _generate(spec: Any, delayed: bool, options: dict[str, Any], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    wrapped = sparsespec.wrap(
        spec.build(), draft=None, delayed_verify=delayed, **({"kv_capacity_tokens": 1024} | options)
    )
    assert wrapped.engine.delayed_verify is delayed
    output = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
    assert_no_slot_leak(wrapped)
    return output, wrapped


def _early_token(spec: Any) -> int:
    """A token some row generates early: as EOS it stops rows mid-run."""
    rows = generated_rows(_generate(spec, False, {})[0], BATCH)
    early = [t for row in rows for t in row[1:6]]
    return max(set(early), key=early.count)


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.id)
def test_delayed_verify_gives_the_synchronous_tokens(spec, loop):
    eos = _early_token(spec)
    for kwargs in ({}, {"eos_token_id": eos}, {"eos_token_id": eos, "min_new_tokens": 7}):
        expected, _ = _generate(spec, False, LOOPS[loop], **kwargs)
        actual, _ = _generate(spec, True, LOOPS[loop], **kwargs)
        assert torch.equal(expected, actual), f"{loop} {kwargs}\n{actual}\n{expected}"
        if kwargs.keys() == {"eos_token_id"}:  # EOS really stopped some rows before the length limit
            lengths = [len(row) for row in generated_rows(actual, BATCH, [eos])]
            assert min(lengths) < MAX_NEW_TOKENS, lengths


def test_delayed_verify_launches_before_reading_back(monkeypatch):
    """The next step is launched before the last one is collected (and not in the synchronous loop), every
    step is collected exactly once, and a decode fed on the device runs while its token is unread."""
    events: dict[bool, list[tuple[str, int]]] = {}
    for delayed in (False, True):
        wrapped = sparsespec.wrap(SPECS[0].build(), draft=None, delayed_verify=delayed, kv_capacity_tokens=1024)
        runner, log = wrapped.engine.runner, events.setdefault(delayed, [])
        launch, collect = runner.launch, runner.collect
        ids: dict[int, int] = {}
        plans: list[StepPlan] = []  # kept alive, so no two plans share an id()
        fed: list[int] = []

        def spy_launch(plan: StepPlan, launch=launch, log=log, ids=ids, fed=fed, plans=plans) -> LaunchedStep:
            plans.append(plan)
            ids[id(plan)] = len(ids)
            log.append(("launch", ids[id(plan)]))
            fed.append(sum(item.ahead > 0 and item.phase is Phase.VERIFY for item in plan.scheduled))
            return launch(plan)

        def spy_collect(step: LaunchedStep, collect=collect, log=log, ids=ids) -> list:
            log.append(("collect", ids[id(step.plan)]))
            return collect(step)

        monkeypatch.setattr(runner, "launch", spy_launch)
        monkeypatch.setattr(runner, "collect", spy_collect)
        wrapped.generate(**BATCH.kwargs(), max_new_tokens=8, do_sample=False)
        collected = [n for kind, n in log if kind == "collect"]
        assert len(collected) == len(set(collected))
        assert any(fed) is delayed
    synchronous = events[False]
    assert synchronous == [(kind, n) for n in range(len(synchronous) // 2) for kind in ("launch", "collect")]
    delayed_log = events[True]
    launched = [n for kind, n in delayed_log if kind == "launch"]
    # Every step but the last is read back only after the next one was launched.
    for n in launched[:-1]:
        assert delayed_log.index(("launch", n + 1)) < delayed_log.index(("collect", n)), delayed_log


def _spy_steps(monkeypatch: pytest.MonkeyPatch, wrapped: Any) -> list[tuple[str, StepPlan]]:
    """Record each launch and collect of ``wrapped``'s runner, in order, with its plan."""
    runner, log = wrapped.engine.runner, []
    launch, collect = runner.launch, runner.collect

    def spy_launch(plan: StepPlan) -> LaunchedStep:
        log.append(("launch", plan))
        return launch(plan)

    def spy_collect(step: LaunchedStep) -> list:
        log.append(("collect", step.plan))
        return collect(step)

    monkeypatch.setattr(runner, "launch", spy_launch)
    monkeypatch.setattr(runner, "collect", spy_collect)
    return log


SPECULATION = {"k": 4, "min_budget": 8, "sparsity": 0.1, "kv_capacity_tokens": 2048}
DENSE = {"k": 4, "min_budget": 512, "kv_capacity_tokens": 2048}  # drafts read everything: all accepted


@pytest.mark.parametrize("cuda_graphs", [None, True], ids=["dynamic", "graphs"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_delayed_speculation_gives_the_draft_none_tokens(policy, cuda_graphs, monkeypatch):
    """Every draft policy with delayed verification: greedy tokens equal draft=None's, plainly, with EOS (an early
    token: rows stop anywhere, mid-round included when drafts are accepted) and with min_new_tokens holding it
    back; no slot leaks. A policy whose chains' lists the runner places launches a request's next round while its
    last one is in flight (rounds ahead, started where only the device knows); any other (one draft per step,
    or choosing inside attention) waits for its last round to be read back, so a step never holds a request of
    the step still in flight."""
    spec = SPECS[0]
    eos = _early_token(spec)
    for options in (SPECULATION, DENSE):
        for kwargs in ({}, {"eos_token_id": eos}, {"eos_token_id": eos, "min_new_tokens": 7}):
            expected, _ = _generate(spec, False, {}, **kwargs)
            wrapped = sparsespec.wrap(
                spec.build(), draft=policy, delayed_verify=True, cuda_graphs=cuda_graphs, **options
            )
            log = _spy_steps(monkeypatch, wrapped)
            actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
            assert torch.equal(expected, actual), f"{policy} {options} {kwargs}\n{actual}\n{expected}"
            assert_no_slot_leak(wrapped)
            assert wrapped.last_stats.num_rounds > 0
            in_flight: dict[int, set[int]] = {}  # launched, not yet collected: plan -> its requests
            twice = 0  # launches holding a request of the step in flight
            for kind, plan in log:
                requests = {id(item.request) for item in plan.scheduled}
                if kind == "launch":
                    twice += any(requests & other for other in in_flight.values())
                    in_flight[id(plan)] = requests
                else:
                    del in_flight[id(plan)]
            assert (twice > 0) == wrapped.engine.rounds_ahead, f"{policy}: {twice} launches ahead"


def test_delayed_speculation_alternates_halves_launched_before_read_back(monkeypatch):
    """With speculation whose rounds cannot launch ahead (a policy choosing inside attention reads positions on
    the host), each step starts the rounds of at most half the decoding requests (rounded up), and every step
    of rounds but the last is read back only after the next one was launched (the prompts' step, whose
    requests all sample, is read back first: nobody is left to run next to it)."""
    wrapped = sparsespec.wrap(SPECS[0].build(), draft="oracle", delayed_verify=True, **SPECULATION)
    assert wrapped.engine.delayed_verify and wrapped.engine.draft_chain and not wrapped.engine.rounds_ahead
    log = _spy_steps(monkeypatch, wrapped)
    wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    plans = [plan for kind, plan in log if kind == "launch"]
    rounds = [plan for plan in plans if any(item.phase is Phase.DRAFT for item in plan.scheduled)]
    assert rounds and max(len(plan.scheduled) for plan in rounds) <= -(-len(BATCH.lengths) // 2)
    order = [(kind, id(plan)) for kind, plan in log]
    for plan in rounds[:-1]:
        following = plans[plans.index(plan) + 1]
        assert order.index(("launch", id(following))) < order.index(("collect", id(plan))), "not overlapped"


def test_rounds_ahead_draft_over_the_whole_recent_window(monkeypatch):
    """A round launched ahead learns from a verify whose true start only the device knows (the round before it
    may have accepted fewer drafts than the host assumed). Its drafts must still read every one of the
    ``recent_window`` positions before their own, each once: with the window cut short at the host's assumed
    start, acceptance fell where the synchronous loop's did not (W1), and positions the Top-K also picks would
    be read twice."""
    window = 16
    wrapped = sparsespec.wrap(
        SPECS[0].build(), draft="pillar_recent", delayed_verify=True, k=4, min_budget=40, sparsity=0.05,
        recent_window=window, kv_capacity_tokens=2048,
    )  # fmt: skip
    assert wrapped.engine.rounds_ahead
    runner, lists = wrapped.engine.runner, []
    round_lists, lookup = runner.builder.round_lists, runner.table.lookup

    def spy_round_lists(drafts, rows, shifts):
        seen = {}

        def spy_lookup(entry_rows, entry_positions):
            seen["positions"] = entry_positions[0, 0].clone()  # the first sparse layer's first KV head
            return lookup(entry_rows, entry_positions)

        monkeypatch.setattr(runner.table, "lookup", spy_lookup)
        built = round_lists(drafts, rows, shifts)
        monkeypatch.setattr(runner.table, "lookup", lookup)
        if built is None:
            return built
        starts = built.view.kv_indptr.tolist()
        behind = [0] * len(drafts) if shifts is None else shifts.tolist()
        for j, forward_ends in enumerate(built.ends.tolist()):  # forward j reads a prefix of each request's list
            for item, start, end, shift in zip(drafts, starts, forward_ends, behind, strict=False):
                if j < item.chain:  # its list ends with its own true position
                    entries = [p for p in seen["positions"][start:end].tolist() if p >= 0]
                    position = item.first_position + j - shift
                    assert entries[-1] == position, f"draft at {position} reads up to {entries[-1]}"
                    lists.append((position, entries, shifts is not None))
        return built

    monkeypatch.setattr(runner.builder, "round_lists", spy_round_lists)
    wrapped.generate(**BATCH.kwargs(), max_new_tokens=40, do_sample=False)
    assert any(ahead for *_, ahead in lists), "no round was launched ahead"
    for position, entries, _ in lists:
        assert len(entries) == len(set(entries)), f"draft at {position} reads a position twice: {sorted(entries)}"
        missing = set(range(max(0, position - window), position + 1)) - set(entries)
        assert not missing, f"draft at {position} misses recent positions {sorted(missing)}"


def test_a_step_around_a_graph_capture_does_not_teach_the_round_length(monkeypatch):
    """A step during which a CUDA graph was captured (W1 on the H200: ~160 ms each, at every new bucket) is no
    measure of what a round or a plain step costs: its cost is not reported to the round length, the others'
    are. Captures are faked here (a CPU captures nothing): every third launch counts one."""
    wrapped = sparsespec.wrap(SPECS[0].build(), draft="pillar_recent", cuda_graphs=True, adaptive_rounds=True, k=4)
    runner, launch, observed = wrapped.engine.runner, wrapped.engine.runner.launch, []
    launches = []

    def launch_and_capture(plan: StepPlan) -> LaunchedStep:
        launches.append(plan)
        if len(launches) % 3 == 0:
            runner.graphs.captures.count += 1
        return launch(plan)

    def observe(scheduler, plan, wall_ms, draft_ms):
        observed.append(plan)

    monkeypatch.setattr(runner, "launch", launch_and_capture)
    monkeypatch.setattr(Scheduler, "observe_step", observe)
    wrapped.generate(**BATCH.kwargs(), max_new_tokens=30, do_sample=False)
    assert observed, "no step's cost was reported"
    # Each capture leaves out the step applied while it ran (the first applied step has no period to report).
    assert len(observed) <= len(launches) - len(launches) // 3 + 1, (len(launches), len(observed))


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("draft", [None, "pillar_recent"])
def test_observers_see_each_applied_step_once_as_it_is_yielded(draft, delayed):
    """An engine's ``observers`` (how benchmarks time and profile a run without touching its internals) get each
    applied step's plan and finished requests: the same objects its steps generator yields, once each, in order,
    as many as the run counts; every request finishes in exactly one of them."""
    engine = sparsespec.wrap(SPECS[0].build(), draft=draft, delayed_verify=delayed, kv_capacity_tokens=1024).engine
    seen = []
    engine.observers.append(lambda plan, finished: seen.append((plan, list(finished))))
    params = SamplingParams(max_new_tokens=40, do_sample=False)
    requests = [engine.new_request(i, prompt, params) for i, prompt in enumerate(BATCH.prompts[:3])]
    yielded = [(plan, list(finished)) for plan, finished in engine.steps(requests)]
    assert len(seen) == len(yielded) == engine.stats_for(requests).steps > 3
    for (seen_plan, seen_finished), (plan, finished) in zip(seen, yielded, strict=True):
        assert seen_plan is plan and [id(r) for r in seen_finished] == [id(r) for r in finished]
    assert sorted(id(r) for _, finished in seen for r in finished) == sorted(id(r) for r in requests)
