"""DraftSampling: a chain forward's token selection from the round's columns equals the general selection."""

from __future__ import annotations

import dataclasses

import torch

from attention import reference
from torchspec.draft_probs import DraftProbsStore, KeptDistributions
from torchspec.draft_sampling import DraftSampling
from torchspec.penalty import penalize
from torchspec.request import Request, SamplingParams
from torchspec.sampling import suppress_stop_tokens, warped_probs

VOCAB = 32
K = 4


def _requests() -> list[Request]:
    """Four requests decoding at different points: sampled with top-k, with top-p, with both, and greedy; the
    first and the last with stop tokens below min_new_tokens for part of the round."""
    params = [
        SamplingParams(max_new_tokens=20, min_new_tokens=6, do_sample=True, temperature=0.7, top_k=5,
                       stop_token_ids=(3, 7)),
        SamplingParams(max_new_tokens=20, do_sample=True, temperature=1.3, top_p=0.8, stop_token_ids=(1,)),
        SamplingParams(max_new_tokens=20, do_sample=True, temperature=0.5, top_k=9, top_p=0.9),
        SamplingParams(max_new_tokens=20, min_new_tokens=20, stop_token_ids=(2,)),
    ]  # fmt: skip
    requests = []
    for i, p in enumerate(params):
        request = Request(request_id=i, prompt_ids=list(range(5 + i)), params=p)
        request.token_ids += [4] * (3 + i)  # 3 + i tokens generated
        request.num_computed_tokens = len(request.token_ids) - 1
        requests.append(request)
    return requests


def _general_selection(
    requests: list[Request], logits: torch.Tensor, forward: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The general path's logits (stop tokens forbidden where the drawn token's output index is below
    min_new_tokens) and the warped distributions of the three sampled requests."""
    expected = logits.clone()
    below = [i for i, r in enumerate(requests) if r.num_output_tokens + forward < r.params.min_new_tokens]
    suppress_stop_tokens(expected, below, [requests[i].params.stop_token_ids for i in below])
    return expected, warped_probs(expected[:3], [r.params for r in requests[:3]])


def _sampling(
    requests: list[Request],
    first_positions: list[int],
    store_rows: list[int],
    store_columns: list[int],
    presence: torch.Tensor | None = None,
) -> DraftSampling:
    """The columns on the CPU, with the reference op set's Top-K."""
    return DraftSampling.of(
        requests, first_positions, store_rows, store_columns, torch.device("cpu"), reference.top_k_positions, presence
    )


def _store(sampling: DraftSampling) -> KeptDistributions:
    """An empty draft-probs store of 8 rows for the round, as the runner reserves it."""
    return DraftProbsStore(K, torch.device("cpu")).reserve(8, VOCAB, 0 if sampling.all_greedy else sampling.support)


def _dense(kept: KeptDistributions) -> torch.Tensor:
    """``[8, K, VOCAB]``: every kept distribution as a row of the vocabulary."""
    rows, index = kept.dense(torch.arange(8 * K), VOCAB)
    return rows[index].view(8, K, VOCAB)


def test_each_forward_samples_from_the_general_warped_distribution_and_keeps_it():
    requests = _requests()
    first_positions = [r.num_computed_tokens for r in requests]  # the round's first draft: its newest token
    store_rows = [5, 0, 2, 7]
    sampling = _sampling(requests, first_positions, store_rows, [0] * len(requests))
    generator = torch.Generator().manual_seed(0)
    for forward in range(1, K):
        logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(forward))
        logits[0, [3, 7]] += 10  # request 0's stop tokens lead its top-k wherever they are allowed
        kept = _store(sampling)
        tokens = sampling.select(logits, forward, kept, generator)
        store = _dense(kept)
        expected, probs = _general_selection(requests, logits, forward)
        for i in range(3):
            torch.testing.assert_close(kept.drawn[store_rows[i], forward], probs[i, tokens[i]])
            torch.testing.assert_close(store[store_rows[i], forward], probs[i])
            assert probs[i, tokens[i]] > 0
        assert tokens[3] == expected[3].argmax()
        # Stops of request 0 (3 outputs before the round, min 6) are forbidden for forwards 1 and 2 only.
        assert bool((store[5, forward, [3, 7]] == 0).all()) == (forward < 3)
        assert expected[3, 2] == float("-inf")  # request 3 never reaches its minimum in this round
        untouched = torch.ones(8, dtype=torch.bool)
        untouched[store_rows] = False
        assert not store[untouched].any() and not store[:, [c for c in range(K) if c != forward]].any()


def test_each_forward_penalises_the_requests_tokens_and_the_rounds_earlier_draws():
    """With a repetition penalty per request (1 = none) and min_p, forward j draws after transformers' penalty
    over the request's tokens and the round's draws of the forwards before j, greedy requests' included: the
    kept distributions are the general path's on the penalised logits, and the greedy request, whose argmax is
    a token it holds or has just drawn, moves on: 9 (its 4 penalised), then 10 (9 drawn), then 4 (both drawn)."""
    requests = _requests()
    penalties, min_ps = [1.5, 1.0, 0.7, 2.0], [0.05, 0.1, 0.0, 0.2]  # the greedy request's min_p: ignored
    for request, penalty, min_p in zip(requests, penalties, min_ps, strict=True):
        request.params = dataclasses.replace(request.params, repetition_penalty=penalty, min_p=min_p)
    seen = torch.zeros(len(requests), VOCAB + 1, dtype=torch.bool)
    for i, request in enumerate(requests):
        seen[i, request.token_ids] = True
    first_positions = [r.num_computed_tokens for r in requests]
    sampling = _sampling(requests, first_positions, [5, 0, 2, 7], [0] * 4, seen.clone())
    generator, greedy_draws = torch.Generator().manual_seed(0), []
    for forward in range(K - 1):
        logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(forward))
        logits[3, [4, 9, 10]] = torch.tensor([5.0, 4.0, 3.0])
        kept = _store(sampling)
        tokens = sampling.select(logits, forward, kept, generator)
        store = _dense(kept)
        expected, _ = _general_selection(requests, logits, forward)
        penalised = penalize(expected, seen, torch.tensor(penalties))
        probs = warped_probs(penalised[:3], [r.params for r in requests[:3]])
        torch.testing.assert_close(store[[5, 0, 2], forward], probs)
        assert all(probs[i, tokens[i]] > 0 for i in range(3))
        greedy_draws.append(int(tokens[3]))
        seen[torch.arange(len(requests)), tokens] = True
    assert greedy_draws == [9, 10, 4]


def test_requests_that_all_filter_by_top_k_warp_over_their_support_alone():
    """With top-k on every sampled request the draft warps the ``max_top_k`` most likely tokens only: the same
    distribution as the general path (random logits: no tie at a row's k-th largest), zeros elsewhere, in the
    model's dtype (bf16 logits are widened as transformers' fp32 path widens them)."""
    requests = _requests()
    requests[1].params = SamplingParams(max_new_tokens=20, do_sample=True, temperature=1.3, top_k=3,
                                        stop_token_ids=(1,))  # fmt: skip
    sampling = _sampling(requests, [r.num_computed_tokens for r in requests], [5, 0, 2, 7], [0] * 4)
    assert sampling.support == 9
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for forward in range(1, K):
            logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(forward)).to(dtype)
            logits[0, [3, 7]] += 10
            kept = _store(sampling)
            assert kept.tokens is not None and kept.probs.shape[-1] == 9, "kept as the support alone"
            tokens = sampling.select(logits, forward, kept, generator)
            expected, probs = _general_selection(requests, logits.float(), forward)
            torch.testing.assert_close(_dense(kept)[[5, 0, 2], forward], probs)
            torch.testing.assert_close(kept.drawn[[5, 0, 2], forward], probs[torch.arange(3), tokens[:3]])
            assert all(probs[i, tokens[i]] > 0 for i in range(3)) and tokens[3] == expected[3].argmax()


def test_a_prefix_keeps_the_first_requests_columns():
    requests = _requests()
    sampling = _sampling(requests, [r.num_computed_tokens for r in requests], [5, 0, 2, 7], [0] * 4)
    assert sampling.prefix(4) is sampling
    two = sampling.prefix(2)
    assert two.store_rows.tolist() == [5, 0] and two.greedy.tolist() == [False, False]
    assert two.max_top_k == 9 and two.stop_tokens.tolist() == [[3, 7], [1, 1]]


def test_greedy_requests_alone_take_the_argmax_below_their_stops_and_keep_nothing():
    requests = _requests()[3:] * 2  # greedy, its stop token 2 forbidden for the whole round
    sampling = _sampling(requests, [r.num_computed_tokens for r in requests], [1, 4], [0, 0])
    assert sampling.all_greedy and sampling.top_k is None and sampling.top_p is None
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, 2] = 100.0
    kept = _store(sampling)
    assert kept.probs.numel() == 0, "a greedy round reserves no distribution"
    tokens = sampling.select(logits, 1, kept, torch.Generator().manual_seed(0))
    expected = logits.clone()
    expected[:, 2] = float("-inf")
    assert tokens.tolist() == expected.argmax(dim=-1).tolist() and not kept.drawn.any()
