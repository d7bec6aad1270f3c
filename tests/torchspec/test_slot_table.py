"""The device slot table: what it gathers equals the host slot lists it mirrors."""

from __future__ import annotations

import torch

from torchspec.request import Request, SamplingParams
from torchspec.slot_table import SlotTable


def _request(request_id: int) -> Request:
    return Request(request_id=request_id, prompt_ids=[1, 2, 3], params=SamplingParams())


def test_gather_and_lookup_follow_the_written_slots_through_growth_and_reuse():
    """Rows are written step by step past the initial width and row count (the table grows, keeping what it
    holds); a rewritten position reads its newest slot; gather returns each row's requested range in order;
    lookup keeps -1 padding; a released row is handed to the next request.

    Protects the runner's slot lists: a stale or misplaced entry would make attention read another token's
    K/V without any error."""
    table = SlotTable(torch.device("cpu"))
    requests = [_request(i) for i in range(10)]
    truth: dict[int, list[int]] = {}
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        rows, positions, slots = [], [], []
        for request in requests:
            row = table.row(request)
            length = 100 * (step + 1) + request.request_id
            start = len(truth.get(row, []))
            new = torch.randint(0, 10_000, (length - start,), generator=generator).tolist()
            truth[row] = truth.get(row, []) + new
            rows += [row] * len(new)
            positions += list(range(start, length))
            slots += new
        table.write(torch.tensor(rows), torch.tensor(positions), torch.tensor(slots), max(positions) + 1)
    # a verify rewrites the last two positions of request 3 with new slots
    row3 = table.row(requests[3])
    last = len(truth[row3])
    table.write(torch.tensor([row3, row3]), torch.tensor([last - 2, last - 1]), torch.tensor([7, 8]), last)
    truth[row3][-2:] = [7, 8]

    rows = [table.row(r) for r in requests]
    starts = [r.request_id for r in requests]
    ends = [len(truth[row]) for row in rows]
    indptr, flat = table.gather(rows, starts, ends)
    expected = [slot for row, start, end in zip(rows, starts, ends, strict=True) for slot in truth[row][start:end]]
    assert flat.tolist() == expected
    assert indptr == [0, *torch.tensor([e - s for s, e in zip(starts, ends, strict=True)]).cumsum(0).tolist()]

    positions = torch.tensor([[0, -1, 5], [2, 3, -1]])
    looked_up = table.lookup(torch.tensor([rows[1], rows[4], rows[4]]), positions)
    assert looked_up.tolist() == [
        [truth[rows[1]][0], -1, truth[rows[4]][5]],
        [truth[rows[1]][2], truth[rows[4]][3], -1],
    ]

    table.release(requests[2])
    assert table.row(_request(99)) == rows[2]
    table.reset()
    fresh = [_request(100 + i) for i in range(10)]
    assert sorted(table.row(r) for r in fresh) == list(range(10))
