"""``offload=True``: requests are admitted by the KV slots they hold, and when the pool is short the most
recently admitted ones move their K/V to the host tier and come back, never recomputed.

With a pool far too small for the batch's worst case, greedy output must equal an unconstrained run token for
token (every draft policy, with and without delayed verification, the graph-padded path), K/V must really
have moved (and back), no prompt token may be computed twice, every device slot and host buffer must be free
at the end, and equal requests must finish in admission order. A host tier too small to make room ends the
newest request with an error naming it (its tokens so far kept) while the others complete.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from tests.torchspec.conftest import Batch, assert_no_slot_leak, generate_checking_key_sketches, tiny_spec
from torchspec import sparsespec
from torchspec.config import DRAFT_POLICIES
from torchspec.host_arena import HostArena, HostMemoryError
from torchspec.kv_cache import SlotAllocator
from torchspec.kv_offload import OffloadStats
from torchspec.request import FinishReason, Request, SamplingParams
from torchspec.scheduler import RESTORE_POOL_SHARE, RESTORE_ROUNDS, Scheduler
from torchspec.step import Phase, ScheduledRequest, StepPlan

SPEC = tiny_spec("llama", 2)
BATCH = Batch((40, 77, 9, 50, 31, 23), seed=3)
MAX_NEW_TOKENS = 40
POOL = 150  # the batch's worst case: 230 prompt + 6 x (40 + 8) = 518 slots
TIGHT = {"kv_capacity_tokens": POOL, "max_batch_size": len(BATCH.lengths), "offload": True}
UNCONSTRAINED = {"kv_capacity_tokens": 2048}


def _generate(spec: Any, draft: str | None, options: dict[str, Any], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Greedy ``generate`` over BATCH; also checks that no prompt token was computed twice and nothing leaked."""
    wrapped = sparsespec.wrap(spec.build(), draft=draft, **options)
    prefilled: Counter[int] = Counter()  # prompt tokens computed per request
    launch = wrapped.engine.runner.launch

    def counting_launch(plan):
        for item in plan.scheduled:
            if item.phase is Phase.PREFILL:
                prefilled[id(item.request)] += item.num_query_tokens
        return launch(plan)

    wrapped.engine.runner.launch = counting_launch
    output = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
    assert sorted(prefilled.values()) == sorted(BATCH.lengths), "a prompt token was computed twice"
    assert_no_slot_leak(wrapped)
    host = wrapped.engine.runner.host
    assert host is None or host.num_requests == 0, "K/V left on the host"
    return output, wrapped


def _assert_moved(wrapped: Any) -> None:
    stats = wrapped.last_stats.offload
    assert stats.offloaded_tokens > 0, stats
    assert stats.restored_tokens == stats.offloaded_tokens, stats
    assert stats.recomputed_tokens == 0, stats
    pool = wrapped.engine.runner.pool
    row_bytes = sum(t[0].numel() * t.element_size() for t in pool.slot_tensors())  # one token: K, V, key sketches
    assert stats.offloaded_bytes == stats.offloaded_tokens * row_bytes, stats
    assert 0 < stats.peak_device_tokens <= POOL, stats
    assert 0 < stats.peak_host_tokens <= stats.offloaded_tokens, stats
    assert stats.reserve_s > 0 and stats.host_reserved_bytes > 0, stats  # the host tier's memory, made in this run


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "delayed"])
@pytest.mark.parametrize("draft", [None, *DRAFT_POLICIES])
def test_offload_gives_the_unconstrained_tokens(draft, delayed):
    options = {"delayed_verify": delayed}
    expected, _ = _generate(SPEC, draft, UNCONSTRAINED | options)
    actual, wrapped = _generate(SPEC, draft, TIGHT | options)
    assert torch.equal(expected, actual), f"{actual}\n{expected}"
    _assert_moved(wrapped)


def test_key_sketches_move_with_their_keys():
    """query_sketch scores the pool's int4 key sketch: a request's sketch goes to the host and back with its K/V
    (and equals the sketch of the keys it comes back beside)."""
    wrapped = sparsespec.wrap(SPEC.build(), draft="query_sketch", recent_window=1, num_sinks=0, **TIGHT)
    generate_checking_key_sketches(wrapped, BATCH, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    _assert_moved(wrapped)


PENALTY = {"repetition_penalty": 1.3}  # each request's token set, on the device by slot-table row, moves too


@pytest.mark.parametrize(
    "spec, options, sampling",
    [
        (tiny_spec("qwen3", 4), {}, {}),
        (SPEC, {"cuda_graphs": True}, {}),  # the graph-padded path (run without capture on a CPU)
        (SPEC, {"delayed_verify": True, "cuda_graphs": True}, {}),
        (SPEC, {"max_step_tokens": 32}, {}),  # prompts prefilled in chunks, next to decodes
        (SPEC, {}, PENALTY),
        (SPEC, {"delayed_verify": True}, PENALTY),
    ],
    ids=["qwen3", "graphs", "graphs-delayed", "chunked-prefill", "penalty", "penalty-delayed"],
)
@pytest.mark.parametrize("draft", [None, "pillar_recent"])
def test_offload_gives_the_unconstrained_tokens_on_every_path(spec, options, sampling, draft):
    expected, _ = _generate(spec, draft, UNCONSTRAINED | options, **sampling)
    actual, wrapped = _generate(spec, draft, TIGHT | options, **sampling)
    assert torch.equal(expected, actual), f"{actual}\n{expected}"
    _assert_moved(wrapped)


def test_offload_with_stop_tokens_landing_mid_run():
    """EOS stops rows at different steps (one late under delayed verification): same tokens as unconstrained."""
    expected, _ = _generate(SPEC, None, UNCONSTRAINED)
    early = Counter(t for row in expected[:, BATCH.width + 1 : BATCH.width + 6].tolist() for t in row)
    eos = early.most_common(1)[0][0]
    for draft in (None, "pillar_recent"):
        for delayed in (False, True):
            options = {"delayed_verify": delayed}
            reference, _ = _generate(SPEC, draft, UNCONSTRAINED | options, eos_token_id=eos)
            actual, _ = _generate(SPEC, draft, TIGHT | options, eos_token_id=eos)
            assert torch.equal(reference, actual), (draft, delayed)


def test_equal_requests_finish_in_admission_order():
    """The oldest requests keep running: equal ones finish in the order they were admitted."""
    wrapped = sparsespec.wrap(SPEC.build(), draft=None, **TIGHT)
    engine = wrapped.engine
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS)
    prompts = Batch((30,) * 6, seed=5).prompts
    requests = [engine.new_request(i, prompt, params) for i, prompt in enumerate(prompts)]
    finished_at: dict[int, int] = {}  # request id -> the step it finished in
    steps = iter(range(10**6))

    def on_step(plan, finished):
        step = next(steps)
        for request in finished:
            finished_at[request.request_id] = step

    stats = engine.run(requests, on_step=on_step)
    assert stats.offload.offloaded_tokens > 0
    steps = [finished_at[i] for i in range(len(prompts))]
    assert steps == sorted(steps), steps
    assert all(len(r.output_ids) == MAX_NEW_TOKENS for r in requests)


def test_host_tier_too_small_ends_the_newest_request_with_its_name():
    """No room on the host to make room in the pool: the newest request ends with an error naming
    host_kv_capacity_tokens, keeping the tokens it made (the unconstrained run's), and the others complete."""
    wrapped = sparsespec.wrap(SPEC.build(), draft=None, host_kv_capacity_tokens=1, **TIGHT)
    _assert_failures_end_alone(wrapped, "host_kv_capacity_tokens=1")


def test_a_host_out_of_memory_ends_the_newest_request_with_why(monkeypatch: pytest.MonkeyPatch):
    """The host has no memory for the host tier to grow by: no request is sent there (the scheduler asks before
    it chooses), the newest one ends with an error saying so, its tokens so far kept (the unconstrained run's),
    and the others complete."""

    def out_of_memory(arena: HostArena, blocks: int) -> None:
        raise HostMemoryError(f"allocating {blocks * arena.block_bytes} bytes (the test's host has none)")

    monkeypatch.setattr(HostArena, "_grow", out_of_memory)
    wrapped = sparsespec.wrap(SPEC.build(), draft=None, **TIGHT)
    _assert_failures_end_alone(wrapped, "(the host had no memory for them: allocating 4194304 bytes")
    assert wrapped.last_stats.offload.offloaded_tokens == 0


def _assert_failures_end_alone(wrapped: Any, error: str) -> None:
    """Greedy over BATCH: some requests end with ``error``, keeping the unconstrained run's tokens so far; the
    others run to their length; nothing leaks."""
    prompts = BATCH.prompts
    params = {"max_new_tokens": MAX_NEW_TOKENS, "min_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
    reference = sparsespec.wrap(SPEC.build(), draft=None, **UNCONSTRAINED).generate_batch(prompts, **params).values()
    outputs = wrapped.generate_batch(prompts, **params).values()
    failed = [o for o in outputs if o.finish_reason == "error"]
    assert failed, "every request completed"
    assert all(error in o.error for o in failed), failed[0].error
    assert any(o.finish_reason == "length" for o in outputs)
    for output, expected in zip(outputs, reference, strict=True):
        assert output.token_ids == expected.token_ids[: len(output.token_ids)]
        if output.finish_reason == "length":
            assert len(output.token_ids) == MAX_NEW_TOKENS
    assert_no_slot_leak(wrapped)
    assert wrapped.engine.runner.host.num_requests == 0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"offload": True, "host_kv_capacity_tokens": 0}, "host_kv_capacity_tokens must be None or an integer >= 1"),
        ({"host_kv_capacity_tokens": 100}, "pass offload=True or leave it at None"),
    ],
)
def test_bad_host_tier_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        sparsespec.wrap(SPEC.build(), **options)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host tier's side stream exists on CUDA only")
@pytest.mark.parametrize("draft", [None, "pillar_recent"])
def test_offload_on_cuda_copies_on_the_side_stream_and_gives_the_same_tokens(draft):
    """Copies overlapping the forwards must still land before a restored request's next step reads them."""
    inputs = {name: tensor.cuda() for name, tensor in BATCH.kwargs().items()}

    def generate(options: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        wrapped = sparsespec.wrap(SPEC.build().cuda(), draft=draft, delayed_verify=True, **options)
        return wrapped.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False), wrapped

    expected, _ = generate(UNCONSTRAINED)
    actual, wrapped = generate(TIGHT)
    assert torch.equal(expected, actual), f"{actual}\n{expected}"
    _assert_moved(wrapped)
    assert wrapped.last_stats.offload.copy_s > 0, wrapped.last_stats.offload


def _decoding_requests(
    count: int, prompt: int, generated: int, restore_step_tokens: int | None = None
) -> tuple[Scheduler, list[Request]]:
    """A scheduler of plain decoding (a round is one token) whose pool is full with ``count`` admitted requests,
    each then ``generated`` tokens further along and so short of slots for its next two rounds."""
    allocator = SlotAllocator(count * (prompt + 2) + count)  # admission leaves a round spare
    scheduler = Scheduler(
        allocator,
        count,
        4096,
        None,
        0,
        offload=OffloadStats(),
        host_capacity_tokens=10**6,
        restore_step_tokens=restore_step_tokens,
    )
    params = SamplingParams(max_new_tokens=1000, min_new_tokens=1000)
    requests = [Request(i, [1] * prompt, params) for i in range(count)]
    for request in requests:
        scheduler.add(request)
    scheduler.schedule()  # admits every one of them
    assert scheduler.running == requests
    allocator.allocate(allocator.num_free)  # held elsewhere: the pool is full
    for request in requests:
        request.token_ids += [2] * generated
        request.num_computed_tokens = len(request.token_ids) - 1
    return scheduler, requests


def test_a_full_pool_sends_out_only_the_requests_its_short_ones_need():
    """Every request a little short, each with a step in flight: the newest one leaves (after its step) and its
    slots serve all the others, which sit one step out; the pool does not send one request out per short one."""
    scheduler, requests = _decoding_requests(12, prompt=400, generated=10)
    in_flight = StepPlan([ScheduledRequest(r, Phase.VERIFY, 1) for r in requests])
    assert scheduler.schedule(in_flight).scheduled == []  # short, or leaving once the step in flight is read back
    plan = scheduler.schedule()
    assert [request for request, _ in plan.offloads] == [requests[-1]]
    assert {item.request for item in plan.scheduled} == set(requests[:-1])
    assert plan.restores == [] and scheduler.offloaded == [requests[-1]]


def test_a_request_sent_out_comes_back_once_the_pool_carries_the_batch_for_a_while():
    """Slots freed by a finishing request bring a request on the host back only with room besides for the running
    batch's next RESTORE_ROUNDS rounds (at most a share of the pool): with room for one round, the pool was short
    again at once and requests traded places every step."""
    scheduler, requests = _decoding_requests(12, prompt=400, generated=10)
    scheduler.schedule()
    back, allocator = requests[-1], scheduler.allocator
    assert scheduler.offloaded == [back]

    def room() -> int:
        return min(RESTORE_ROUNDS * len(scheduler.running), allocator.num_slots // RESTORE_POOL_SHARE)

    need = len(back.token_ids) + 2  # its tokens and two rounds of one token
    scheduler.finish(requests[0], FinishReason.LENGTH)
    assert need + len(scheduler.running) <= allocator.num_free < need + room()
    assert scheduler.schedule().restores == []
    scheduler.finish(requests[1], FinishReason.LENGTH)
    assert allocator.num_free >= need + room()
    assert scheduler.schedule().restores == [back]


@pytest.mark.parametrize("budget", [None, 1, 1200])
def test_a_step_brings_back_what_its_staging_budget_holds(budget):
    """Room for every request on the host at once: a step brings back the oldest, then more while their K/V rows
    stay within ``restore_step_tokens`` (each is staged on the device whole before its scatter)."""
    scheduler, _ = _decoding_requests(12, prompt=400, generated=150, restore_step_tokens=budget)
    scheduler.schedule()
    scheduler.schedule()
    away = list(scheduler.offloaded)
    assert len(away) == 4
    for request in list(scheduler.running):
        scheduler.finish(request, FinishReason.LENGTH)
    back = scheduler.schedule().restores
    fits = len(away) if budget is None else max(1, budget // away[0].num_computed_tokens)
    assert back == away[:fits] and scheduler.offloaded == away[fits:]
