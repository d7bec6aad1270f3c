"""The repetition penalty: bit-exact with transformers' processor, and its token sets on the device."""

from __future__ import annotations

import collections
import gc
import math
import weakref

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tests.torchspec.conftest import tiny_spec
from torchspec import sparsespec
from torchspec.penalty import TokenPresence, penalize
from torchspec.request import Request, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 50
CPU = torch.device("cpu")


def _seen(contexts: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """``[R, V + 1]`` bool: each row's context tokens."""
    seen = torch.zeros(len(contexts), vocab + 1, dtype=torch.bool)
    for row, tokens in enumerate(contexts):
        seen[row, tokens] = True
    return seen


def test_penalize_matches_transformers():
    """Per-row penalties (above 1, below 1, 1) over contexts with repeats: each row bit-identical to
    transformers' processor on that row alone, a suppressed (-inf) token staying -inf, a penalty of 1 changing
    nothing."""
    generator = torch.Generator().manual_seed(0)
    penalties = [1.3, 0.7, 1.0, 2.0, 1.05]
    logits = torch.randn(len(penalties), VOCAB, generator=generator) * 3
    logits[0, 7] = -math.inf
    contexts = [torch.randint(0, VOCAB, (3 + 5 * row,), generator=generator).tolist() for row in range(len(penalties))]
    contexts[0].append(7)
    actual = penalize(logits, _seen(contexts), torch.tensor(penalties))
    for row, (penalty, context) in enumerate(zip(penalties, contexts, strict=True)):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([context]), logits[row : row + 1].clone())[0]
        assert torch.equal(actual[row], expected), f"row {row} (penalty {penalty})"
    assert torch.equal(actual[2], logits[2]) and actual[0, 7] == -math.inf


def _request(request_id: int, tokens: list[int], penalty: float = 1.3) -> Request:
    return Request(request_id=request_id, prompt_ids=tokens, params=SamplingParams(repetition_penalty=penalty))


def _tokens(presence: TokenPresence, row: int) -> set[int]:
    return set(presence.mask[row, :VOCAB].nonzero()[:, 0].tolist())


def test_presence_tracks_records_and_marks_a_rounds_drafts():
    """A request's row is written from its tokens when it is first read there; emitting steps add their
    accepted drafts and next token only (a rejected draft leaves no mark); reading it again in the same row
    keeps what its steps added, while another request taking the row over rewrites it; a round's drafts so far
    are marked in the copy a draft forward reads, not in the mask; a row past the mask grows it, every row
    kept. A request without a penalty is never written."""
    presence = TokenPresence(CPU)
    first, second = _request(0, [1, 2, 2, 3]), _request(1, [4])
    presence.round_sets([first, second, _request(5, [9], penalty=1.0)], [0, 1, 2], VOCAB, [[], [], []])
    assert _tokens(presence, 0) == {1, 2, 3} and _tokens(presence, 1) == {4} and _tokens(presence, 2) == set()
    # Row 0 accepted 1 of drafts [10, 11] and then emits 12; row 1 (a final prompt chunk) emits 13.
    rows, drafts = torch.tensor([0, 1]), torch.tensor([[10, 11], [0, 0]])
    presence.record(rows, drafts, torch.tensor([1, 0]), torch.tensor([12, 13]))
    assert _tokens(presence, 0) == {1, 2, 3, 10, 12} and _tokens(presence, 1) == {4, 13}
    seen = presence.round_sets([first, second], [0, 1], VOCAB, [[20], [20, 21]])
    assert seen.shape == (2, VOCAB + 1)
    marked = [set(row[:VOCAB].nonzero()[:, 0].tolist()) for row in seen]
    assert marked == [{1, 2, 3, 10, 12, 20}, {4, 13, 20, 21}], "a request's own row was rewritten from its tokens"
    assert _tokens(presence, 0) == {1, 2, 3, 10, 12}, "a round's drafts were marked in the mask"
    second.token_ids.append(13)  # what the host reads back; the request then moves to row 9 (back from the host)
    presence.round_sets([_request(2, [5, 6]), second], [0, 9], VOCAB, [[], []])
    assert presence.mask.shape[0] >= 10 and _tokens(presence, 0) == {5, 6} and _tokens(presence, 9) == {4, 13}
    assert _tokens(presence, 1) == {4, 13}


def test_penalize_rows_adds_the_drafts_before_each_row():
    """A verify's row j is penalised by the request's tokens and its drafts 0..j-1: with penalty 2 on logits of
    4 where a token is held, row j halves exactly the logits of the prompt's token and of the first j drafts;
    the rows of requests not listed are left alone."""
    presence = TokenPresence(CPU)
    request = _request(0, [7], penalty=2.0)
    logits = torch.full((5, VOCAB), 4.0)  # row 0: another request's; rows 1-4: the verify of drafts 10, 11, 12
    penalised = presence.penalize_rows(
        logits, [request], [3], np.array([1]), np.array([4]), torch.tensor([[10, 11, 12]])
    )
    halved = [set((penalised[row] == 2.0).nonzero()[:, 0].tolist()) for row in range(5)]
    assert halved == [set(), {7}, {7, 10}, {7, 10, 11}, {7, 10, 11, 12}]


def test_a_row_given_back_forgets_its_request():
    """A request that gives its row back is no longer referenced by the token sets (a finished request is not
    kept alive by them); one that comes back to the same row is written again from its tokens, those it gained
    meanwhile included."""
    presence = TokenPresence(CPU)
    leaving, returning = _request(0, [1, 2]), _request(1, [3])
    presence.round_sets([leaving, returning], [0, 1], VOCAB, [[], []])
    gone = weakref.ref(leaving)
    presence.forget(0)
    presence.forget(1)
    del leaving
    gc.collect()
    assert gone() is None
    returning.token_ids.append(4)  # what it generated while its K/V was on the host
    presence.round_sets([returning], [1], VOCAB, [[]])
    assert _tokens(presence, 1) == {3, 4}


def test_finished_requests_are_not_kept_by_the_engine():
    """After a run with a repetition penalty, the engine holds none of its requests (the token sets and the
    slot table forgot them as they finished)."""
    model = sparsespec.wrap(tiny_spec("llama").build(), draft="pillar_recent", k=3)
    engine = model.engine
    params = SamplingParams(max_new_tokens=12, repetition_penalty=1.3)
    requests = [engine.new_request(i, [3 + i, 4, 5, 6], params) for i in range(3)]
    collections.deque(engine.steps(requests), maxlen=0)  # run to the end, keeping no step's plan
    assert all(request.is_finished and not request.error for request in requests)
    refs = [weakref.ref(request) for request in requests]
    del requests
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
