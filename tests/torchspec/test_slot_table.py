"""The device slot table: what it gathers equals the host slot lists it mirrors."""

from __future__ import annotations

import copy

import torch

from torchspec.request import Request, SamplingParams
from torchspec.slot_table import SlotTable


def _request(request_id: int, slots: list[int] | None = None) -> Request:
    request = Request(request_id=request_id, prompt_ids=[1, 2, 3], params=SamplingParams())
    request.slots = slots or []
    return request


def test_gather_and_lookup_follow_the_requests_slots_through_growth_and_reuse():
    """Each request's slots are written when it first gets a row, past the initial width and row count (the
    table grows, keeping what it holds); gather returns each row's requested range in order; lookup keeps -1
    padding; a released row is handed to the next request, which reads its own slots there.

    Protects the runner's slot lists: a stale or misplaced entry would make attention read another token's
    K/V without any error."""
    table = SlotTable(torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    truth: dict[int, list[int]] = {}
    requests = []
    for i in range(10):  # longer and longer: the width grows while rows are held
        slots = torch.randint(0, 10_000, (100 * i + 7,), generator=generator).tolist()
        requests.append(_request(i, slots))
        truth[table.row(requests[-1])] = slots

    rows = [table.row(r) for r in requests]
    starts = [r.request_id for r in requests]
    ends = [len(truth[row]) for row in rows]
    indptr, flat = table.gather(rows, starts, ends)
    expected = [slot for row, start, end in zip(rows, starts, ends, strict=True) for slot in truth[row][start:end]]
    assert flat.tolist() == expected
    assert indptr.tolist() == [0, *torch.tensor([e - s for s, e in zip(starts, ends, strict=True)]).cumsum(0).tolist()]

    positions = torch.tensor([[0, -1, 5], [2, 3, -1]])
    looked_up = table.lookup(torch.tensor([rows[1], rows[4], rows[4]]), positions)
    assert looked_up.tolist() == [
        [truth[rows[1]][0], -1, truth[rows[4]][5]],
        [truth[rows[1]][2], truth[rows[4]][3], -1],
    ]

    table.release(requests[2])
    newcomer = _request(99, [5, 6, 7])
    assert table.row(newcomer) == rows[2]
    assert table.gather([rows[2]], [0], [3])[1].tolist() == [5, 6, 7]
    table.reset()
    fresh = [_request(100 + i) for i in range(10)]
    assert sorted(table.row(r) for r in fresh) == list(range(10))


def test_extend_writes_every_requests_new_slots_in_one_call():
    """Requests admitted by use (``offload``) are topped up a chunk at a time, hundreds a step, all written in one
    call: each row then holds its request's whole slot list, past the table's width too; a request with nothing
    new, or without a row yet, is left alone (the latter gets its slots when it takes a row)."""
    table = SlotTable(torch.device("cpu"))
    requests = [_request(i, list(range(100 * i, 100 * i + 20))) for i in range(4)]
    rows = [table.row(r) for r in requests]
    requests[0].slots = requests[0].slots + list(range(5000, 5300))  # past the table's width (256)
    requests[2].slots = [*requests[2].slots, 7, 8, 9]
    rowless = _request(9, [1, 2])
    rowless.slots = [*rowless.slots, 3]
    table.extend([*requests, rowless])
    for request, row in zip(requests, rows, strict=True):
        assert table.gather([row], [0], [len(request.slots)])[1].tolist() == request.slots
    assert table.gather([table.row(rowless)], [0], [3])[1].tolist() == [1, 2, 3]


def test_requests_are_told_apart_by_identity():
    """The scheduler looks requests up in its running list; two with equal fields are still two requests, and a
    lookup never compares their fields (at 1,024 requests admitted by use, field-by-field comparisons made
    scheduling a step take 465 ms on the H200)."""
    first = _request(1, [4, 5])
    twin = copy.copy(first)  # every field equal
    assert first != twin and twin not in [first] and first in [twin, first]
