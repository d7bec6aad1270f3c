"""A plan's columns (``StepPlan.columns``): the runner reads its per-request numbers from these arrays, so each
entry must be what the scheduled request itself says, for every kind of step in one plan."""

from __future__ import annotations

from torchspec.request import Request, SamplingParams
from torchspec.step import Phase, PlanColumns, ScheduledRequest, StepPlan


def _request(prompt: int, generated: int, computed: int, drafts: list[int] | None = None) -> Request:
    request = Request(request_id=0, prompt_ids=list(range(1, prompt + 1)), params=SamplingParams(max_new_tokens=64))
    request.token_ids += list(range(100, 100 + generated))
    request.num_computed_tokens = computed
    request.round.tokens = list(drafts or [])
    return request


def test_plan_columns_hold_each_scheduled_request_s_own_numbers():
    items = [
        ScheduledRequest(_request(5, 3, 7), Phase.DRAFT, 1, chain=4, verifies=True),  # a round's first draft
        ScheduledRequest(_request(5, 3, 7, drafts=[9, 8]), Phase.DRAFT, 1),  # a later draft: fed its last draft
        ScheduledRequest(_request(6, 4, 9, drafts=[1, 2, 3]), Phase.VERIFY, 4),  # a verify of three drafts
        ScheduledRequest(_request(6, 4, 9), Phase.VERIFY, 1, ahead=3, bound=True),  # a plain step launched ahead
        ScheduledRequest(_request(40, 0, 8), Phase.PREFILL, 16),  # a chunk short of the prompt's end
        ScheduledRequest(_request(40, 0, 24), Phase.PREFILL, 16),  # the final chunk: samples one row
    ]
    columns = StepPlan(items).columns
    expected = {
        "first_position": [item.first_position for item in items],
        "num_query_tokens": [item.num_query_tokens for item in items],
        "is_draft": [item.phase is Phase.DRAFT for item in items],
        "device_computed": [item.request.num_computed_tokens + item.ahead for item in items],
        "checked_drafts": [0, 0, 3, 0, 0, 0],
        "sampled_rows": [1, 1, 4, 1, 0, 1],
        "fed": [True, False, True, True, False, False],
        "num_prompt_tokens": [5, 5, 6, 6, 40, 40],
    }
    assert set(expected) == set(PlanColumns._fields)
    for name, values in expected.items():
        assert getattr(columns, name).tolist() == values, name
    assert columns.is_draft.dtype == bool and columns.fed.dtype == bool


def test_an_empty_plan_has_empty_columns():
    columns = StepPlan([]).columns
    assert all(getattr(columns, name).shape == (0,) for name in PlanColumns._fields)
