"""The garbage collector leaves a run's long-lived objects alone while it runs and gets them all back at its end.

A full collection walks every item of every list it tracks: W1's 256 slot lists of ~8.4K slots cost ~8 ms a pass
on the H100's host, about every 100 plain steps, unless frozen as their requests start."""

from __future__ import annotations

import gc

import pytest

from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import sparsespec
from torchspec.request import SamplingParams
from torchspec.step import StepPlan


@pytest.mark.parametrize(
    ("draft", "options"),
    [
        (None, {"max_batch_size": 2}),
        ("pillar_recent", {"max_batch_size": 2}),
        (None, {"offload": True, "kv_capacity_tokens": 48}),
    ],
    ids=["plain", "pillar_recent", "offload"],
)
def test_running_requests_slot_lists_stay_out_of_the_collector_s_passes(draft, options):
    """Three prompts, two at a time (the third starts when one finishes), or all three in a pool too small for
    them (requests move to the host tier and come back with new slot lists): after every step, no scheduled
    request's slot list is among the objects a collection walks; at the end nothing the run froze stays frozen."""
    wrapped = sparsespec.wrap(tiny_spec("llama").build(), draft=draft, k=3, min_budget=4, **options)
    engine = wrapped.engine
    params = SamplingParams(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    requests = [engine.new_request(i, list(p), params) for i, p in enumerate(Batch((9, 14, 11), seed=2).prompts)]
    walked_lists: list[int] = []  # per step: scheduled requests whose slot list a collection would walk

    def check(plan: StepPlan, finished: list) -> None:
        walked = {id(obj) for obj in gc.get_objects()}
        slots = [item.request.slots for item in plan.scheduled if item.request not in finished]
        walked_lists.append(sum(id(held) in walked for held in slots))

    frozen_before = gc.get_freeze_count()
    stats = engine.run(requests, on_step=check)
    assert all(request.num_output_tokens == 12 for request in requests)
    if options.get("offload"):
        assert stats.offload.restored_tokens > 0
    assert walked_lists and not any(walked_lists), walked_lists
    assert gc.get_freeze_count() == frozen_before
