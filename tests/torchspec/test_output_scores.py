"""``output_scores`` and ``output_logits`` with ``return_dict_in_generate``: per generated token, the distribution it
was chosen from as transformers' ``generate`` reports it (the logits after every processor and warper, and the raw
logits), with speculation on: a verify's rows of the tokens it emitted, a plain step's one row."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import logits_process as processing

from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import sparsespec

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = tiny_spec("llama")
BATCH = Batch((5, 9, 13), seed=3)
NEW_TOKENS = 12
KEEP = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
# Every row runs its whole length (EOS forbidden until then), so transformers scores no padding.
LENGTHS = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}


def _assert_steps_close(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    assert len(actual) == len(expected) == NEW_TOKENS
    for step, (ours, theirs) in enumerate(zip(actual, expected, strict=True)):
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape, step
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), f"step {step}: filtered entries differ"
        finite = torch.isfinite(theirs)
        torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("draft", [None, "pillar"])
def test_greedy_scores_and_logits_equal_transformers(draft):
    """Greedy with a repetition penalty and EOS held back: the same sequences, and per step the same processed
    scores and raw logits as transformers' ``generate``."""
    options = {**LENGTHS, **KEEP, "do_sample": False, "repetition_penalty": 1.3}
    expected = SPEC.build().generate(**BATCH.kwargs(), **options)
    wrapped = sparsespec.wrap(SPEC.build(), draft=draft, k=4, min_budget=8, sparsity=0.3)
    actual = wrapped.generate(**BATCH.kwargs(), **options)
    assert torch.equal(actual.sequences, expected.sequences)
    _assert_steps_close(actual.scores, expected.scores)
    _assert_steps_close(actual.logits, expected.logits)
    if draft is not None:
        assert wrapped.last_stats.num_rounds > 0, "no speculation round ran"


def test_sampled_scores_are_the_warped_distributions_of_the_sampled_tokens():
    """Sampled with every warper: each step's scores are transformers' processors applied to the model's logits
    for the sequence drawn so far (one forward over the finished sequences gives them), and each drawn token is
    one the scores allow."""
    options = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05}
    options |= {"repetition_penalty": 1.2, **LENGTHS, **KEEP}
    wrapped = sparsespec.wrap(SPEC.build(), draft="pillar", k=4, min_budget=8, sparsity=0.3)
    torch.manual_seed(0)
    actual = wrapped.generate(**BATCH.kwargs(), **options)
    assert wrapped.last_stats.num_rounds > 0
    _, attention_mask = BATCH.tensors()
    sequences, width = actual.sequences, BATCH.width
    mask = torch.cat([attention_mask, torch.ones(len(BATCH.lengths), NEW_TOKENS, dtype=attention_mask.dtype)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = SPEC.build()(input_ids=sequences, attention_mask=mask, position_ids=positions).logits.float()
    eos = SPEC.build().config.eos_token_id  # transformers holds it back below min_new_tokens (where it has one)
    held_back = [] if eos is None else [processing.MinNewTokensLengthLogitsProcessor(width, NEW_TOKENS, eos)]
    processors = processing.LogitsProcessorList(held_back)
    processors += [
        processing.RepetitionPenaltyLogitsProcessor(1.2),
        processing.TemperatureLogitsWarper(0.8),
        processing.TopKLogitsWarper(20),
        processing.TopPLogitsWarper(0.9),
        processing.MinPLogitsWarper(0.05),
    ]
    starts = [width - n for n in BATCH.lengths]  # each row's tokens without its padding (generate penalises none)
    expected = tuple(
        torch.cat([processors(sequences[r : r + 1, start : width + t], logits[r : r + 1, width + t - 1].clone())
                   for r, start in enumerate(starts)])
        for t in range(NEW_TOKENS)
    )  # fmt: skip
    _assert_steps_close(actual.scores, expected)
    _assert_steps_close(actual.logits, tuple(logits[:, width + t - 1] for t in range(NEW_TOKENS)))
    for step, scores in enumerate(actual.scores):
        drawn = sequences[:, width + step]
        assert torch.isfinite(scores.gather(1, drawn[:, None])).all(), f"step {step}: a token its scores forbid"


def test_rows_past_a_sequence_end_hold_minus_infinity():
    """A row that stopped early (EOS) has no scores past its end: those steps hold -inf, as documented."""
    wrapped = sparsespec.wrap(SPEC.build(), draft="pillar", k=4, min_budget=8, sparsity=0.3)
    prompts = BATCH.kwargs()
    eos = int(wrapped.generate(**prompts, max_new_tokens=3, do_sample=False)[0, BATCH.width + 1])
    out = wrapped.generate(**prompts, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, **KEEP)
    ended = out.sequences[0, BATCH.width :].tolist().index(eos) + 1  # row 0 stops at its second token
    assert ended == 2
    assert all(torch.isinf(step[0]).all() for step in out.scores[ended:])
    assert all(torch.isfinite(step[0]).any() for step in out.scores[:ended])
