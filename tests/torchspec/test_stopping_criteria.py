"""``stopping_criteria`` and ``stop_strings`` stop a request as transformers' ``generate`` does, token for token,
with speculation on: the criteria are checked on the host as each token of a round is committed, the request stops
at the first token where one says stop and the round's tokens past it are discarded.

The tiny-model tests run every commit path (draft chains, one draft per step, no speculation with delayed
verification); the SmolLM2 ones run the clients' calls (``stop_strings`` with a tokenizer, lm-eval's
``generate_until``) against the plain model's own ``generate``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from tests.torchspec.conftest import Batch, Reference, assert_no_slot_leak, assert_same_tokens, tiny_spec
from torchspec import SparseSpecForCausalLM, sparsespec

pytestmark = pytest.mark.usefixtures("single_thread")

# An EOS id the rows never generate: transformers pads a stopped row only when the model has an EOS (without one
# it keeps generating into the row until every row has stopped).
SPEC = tiny_spec("llama", 2, eos_token_id=5)
BATCH = Batch((7, 12), seed=3)
MAX_NEW_TOKENS = 40
PATHS = [
    pytest.param({}, id="draft-chain"),
    pytest.param({"draft_chain": False}, id="one-draft-per-step"),
    pytest.param({"draft": None}, id="no-speculation-delayed-verify"),
]


class EndsWith(StoppingCriteria):
    """Stops the rows whose last tokens are ``tail`` (stateless and row-wise, like ``StopStringCriteria``)."""

    def __init__(self, tail: list[int]) -> None:
        self.tail = torch.tensor(tail)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        if input_ids.shape[1] < len(self.tail):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return (input_ids[:, -len(self.tail) :] == self.tail).all(dim=1)


class GeneratedCount(StoppingCriteria):
    """Stops the rows that generated ``count`` copies of ``token``, counted from the batch's input width (so the
    row it sees must hold the caller's padding, as transformers' does)."""

    def __init__(self, width: int, token: int, count: int) -> None:
        self.width, self.token, self.count = width, token, count

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return (input_ids[:, self.width :] == self.token).sum(dim=1) >= self.count


class MultiTokenEOSCriteria(StoppingCriteria):
    """lm-eval 0.4's criterion for ``generate_until`` (lm_eval/models/utils.py), as it is: it decodes the last
    tokens of each row past the input and answers one bool for the batch, True once every row holds ``sequence``."""

    def __init__(self, sequence: str, tokenizer: Any, initial_decoder_input_length: int, batch_size: int) -> None:
        self.initial_decoder_input_length = initial_decoder_input_length
        self.done_tracker = [False] * batch_size
        self.sequence = sequence
        self.sequence_ids = tokenizer.encode(sequence, add_special_tokens=False)
        self.sequence_id_len = len(self.sequence_ids) + 2
        self.tokenizer = tokenizer

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> bool:
        lookback_ids_batch = input_ids[:, self.initial_decoder_input_length :]
        lookback_ids_batch = lookback_ids_batch[:, -self.sequence_id_len :]
        lookback_tokens_batch = self.tokenizer.batch_decode(lookback_ids_batch)
        for i, done in enumerate(self.done_tracker):
            if not done:
                self.done_tracker[i] = self.sequence in lookback_tokens_batch[i]
        return False not in self.done_tracker


def _committed_past(output: Any) -> int:
    """Tokens the engine produced for a request beyond those it kept (the prompt's token, then each round's
    accepted drafts and its own token): more than zero when a stop landed inside a round."""
    speculation = output.stats.speculation
    produced = 1 + sum(speculation.accepted_per_round) + len(speculation.accepted_per_round)
    return produced - len(output.token_ids)


# -- every commit path, on a tiny model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain() -> torch.Tensor:
    """transformers' greedy output for BATCH without criteria: where the tests pick their stops."""
    with torch.inference_mode():
        return SPEC.build().generate(**BATCH.kwargs(), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)


@pytest.mark.parametrize("options", PATHS)
def test_custom_criteria_match_transformers(
    hf_reference: Reference, plain: torch.Tensor, options: dict[str, Any]
) -> None:
    """Two row-wise criteria, one reading the padded input width: the first row stops mid-generation (inside a
    round with speculation), the second runs to max_new_tokens; the tensor equals transformers'."""
    generated = plain[0, BATCH.width :].tolist()
    stop_at = 13  # the first row stops after its 14th new token (inside the second round with k = 8)
    token = generated[stop_at]
    count = generated[: stop_at + 1].count(token)
    assert (plain[1, BATCH.width :] == token).sum() < count, "pick a token the second row generates less often"
    criteria = StoppingCriteriaList([GeneratedCount(BATCH.width, token, count), EndsWith([0, 0, 0])])
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "stopping_criteria": criteria}
    expected = hf_reference(SPEC, BATCH, **kwargs)
    assert expected.shape[1] == plain.shape[1] and not torch.equal(expected, plain), "the first row should stop"
    wrapped = sparsespec.wrap(SPEC.build(), max_batch_size=2, **options)
    actual = wrapped.generate(**BATCH.kwargs(), do_sample=False, **kwargs)
    assert_same_tokens(expected, actual, SPEC, BATCH)
    assert wrapped.last_stats.generated_tokens == stop_at + 1 + MAX_NEW_TOKENS
    assert_no_slot_leak(wrapped)


@pytest.mark.parametrize("options", PATHS)
def test_generate_batch_stops_inside_a_round(plain: torch.Tensor, options: dict[str, Any]) -> None:
    """generate_batch and stream: the request ends with finish_reason "stop" at the first token a criterion
    stops at (here the round that makes it makes more, which are discarded); the other request continues."""
    prompts = BATCH.prompts
    generated = plain[0, BATCH.width :].tolist()
    tail = generated[10:12]  # ends the first row at its 12th new token
    assert not any(generated[i : i + 2] == tail for i in range(10)), "the tail should first appear there"
    criteria = StoppingCriteriaList([EndsWith(tail)])
    wrapped = sparsespec.wrap(SPEC.build(), max_batch_size=2, **options)
    outputs = list(
        wrapped.generate_batch(
            prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, stopping_criteria=criteria, progress_bar=False
        ).values()
    )
    assert outputs[0].token_ids == generated[:12] and outputs[0].finish_reason == "stop"
    second = plain[1, BATCH.width :].tolist()
    assert not any(second[i : i + 2] == tail for i in range(len(second) - 1)), "the second row should not stop"
    assert outputs[1].token_ids == second and outputs[1].finish_reason == "length"
    if options.get("draft", "on") is not None:
        assert _committed_past(outputs[0]) > 0, "the stop should land inside a round"
    steps = wrapped.stream(prompts[0], max_new_tokens=MAX_NEW_TOKENS, stopping_criteria=criteria)
    streamed = [token for step in steps for token in step]
    assert streamed == generated[:12]
    assert_no_slot_leak(wrapped)


def test_no_criteria_cost_nothing(plain: torch.Tensor) -> None:
    """An empty criteria list asks for nothing: the requests carry none and the output is the plain one."""
    wrapped = sparsespec.wrap(SPEC.build(), max_batch_size=2)
    actual = wrapped.generate(
        **BATCH.kwargs(), do_sample=False, max_new_tokens=MAX_NEW_TOKENS, stopping_criteria=StoppingCriteriaList()
    )
    assert torch.equal(actual, plain)
    nothing = {"max_new_tokens": 4, "stopping_criteria": StoppingCriteriaList()}
    ((request,),) = wrapped._requests_for([BATCH.prompts[0]], None, nothing)
    assert request.params.stopping_criteria is None and request.criteria is None


def test_still_refused_options_name_themselves() -> None:
    wrapped = sparsespec.wrap(SPEC.build(), max_batch_size=2)
    with pytest.raises(ValueError, match="`logits_processor` is not supported"):
        wrapped.generate(**BATCH.kwargs(), logits_processor=LogitsProcessorList([lambda ids, scores: scores]))


# -- the clients' calls, on SmolLM2 (fp32) -----------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def smol(smollm2: tuple[Any, Any]) -> tuple[Any, Any, SparseSpecForCausalLM]:
    """(model, tokenizer, the model wrapped with the default options: speculation on, k = 8), no tokenizer given
    to wrap: the calls pass it, as transformers asks."""
    model, tokenizer = smollm2
    return model, tokenizer, sparsespec.wrap(model, max_batch_size=len(PROMPTS))


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"stop_strings": [" 9,"]}, id="one-row-stops-early"),
        pytest.param({"stop_strings": ["12", "xyz"]}, id="inside-a-token"),
        pytest.param({"stop_strings": "."}, id="one-string"),
        pytest.param({"stop_strings": ["."], "min_new_tokens": 20}, id="min-new-tokens-as-transformers"),
    ],
)
def test_stop_strings_match_transformers(smol: tuple[Any, Any, SparseSpecForCausalLM], options: dict) -> None:
    """Left-padded batch of two: the tensor equals transformers' ``generate`` with the same ``stop_strings``.
    transformers does not hold a stop string back for ``min_new_tokens`` (that only keeps EOS from being
    sampled), and neither does torchspec."""
    model, tokenizer, wrapped = smol
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kwargs = {"max_new_tokens": 40, "do_sample": False, "tokenizer": tokenizer, **options}
    expected = model.generate(**batch, **kwargs)
    actual = wrapped.generate(**batch, **kwargs)
    assert torch.equal(actual, expected), (tokenizer.batch_decode(actual), tokenizer.batch_decode(expected))
    unstopped = model.generate(**batch, max_new_tokens=40, do_sample=False)
    assert expected.shape != unstopped.shape or not torch.equal(expected, unstopped), "a row should stop at a string"
    assert_no_slot_leak(wrapped)


@pytest.mark.slow
def test_stop_strings_in_generate_batch(smollm2: tuple[Any, Any]) -> None:
    """generate_batch with the tokenizer given to wrap: "stop" at the string, mid-round, the text ends with it."""
    model, tokenizer = smollm2
    wrapped = sparsespec.wrap(model, tokenizer=tokenizer, max_batch_size=len(PROMPTS))
    outputs = list(
        wrapped.generate_batch(
            PROMPTS, max_new_tokens=40, do_sample=False, stop_strings=[" 9,"], progress_bar=False
        ).values()
    )
    assert outputs[1].text == " 4, 5, 6, 7, 8, 9," and outputs[1].finish_reason == "stop"
    assert _committed_past(outputs[1]) > 0, "the stop should land inside a round"
    assert outputs[0].finish_reason == "stop" and " 9," not in outputs[0].text  # its EOS


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2], ids=["batch-1", "batch-2"])
def test_lm_eval_generate_until_call(smol: tuple[Any, Any, SparseSpecForCausalLM], rows: int) -> None:
    """lm-eval 0.4.13's ``generate_until`` call (left-padded, ``max_length``, its multi-token criterion over the
    batch, ``pad_token_id``, ``use_cache``): every row stops at its ``until`` string as with the plain model's
    generate. One row: the same tensor. Two: the criterion keeps a flag per row and says stop once every row has
    shown the string, which it must see in its own row (a batch of one row failed it with an IndexError); rows
    advance at their own pace here, so a row may run on a few tokens more or less than transformers' past the
    string, and the text up to it (what lm-eval keeps) is the same."""
    model, tokenizer, wrapped = smol
    prompts = PROMPTS[:1] if rows == 1 else ["1, 2, 3,", "10, 11, 12,"]  # the second row shows " 15" first
    context = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    until, width, max_gen_toks = " 15" if rows == 2 else "answer is", context["input_ids"].shape[1], 64

    def call(target: Any) -> torch.Tensor:
        criteria = StoppingCriteriaList([MultiTokenEOSCriteria(until, tokenizer, width, rows)])
        return target.generate(
            **context,
            max_length=width + max_gen_toks,
            stopping_criteria=criteria,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,
            do_sample=False,
        )

    expected, actual = call(model), call(wrapped)
    if rows == 1:
        assert torch.equal(actual, expected)
    cut = [tokenizer.decode(row[width:], skip_special_tokens=True).split(until)[0] for row in (*expected, *actual)]
    assert cut[:rows] == cut[rows:], cut
    for row in actual:
        assert until in tokenizer.decode(row[width:]), tokenizer.decode(row[width:])
    assert actual.shape[1] - width < max_gen_toks, "the rows should stop at the string, not at max_length"


def test_stop_strings_without_a_tokenizer_say_how() -> None:
    """As transformers: stop strings need the tokenizer; the message names where to pass it."""
    wrapped = sparsespec.wrap(SPEC.build(), max_batch_size=2)
    with pytest.raises(ValueError, match=r"`stop_strings` need the model's tokenizer.*pass `tokenizer=`"):
        wrapped.generate(**BATCH.kwargs(), max_new_tokens=4, stop_strings=["."])
    with pytest.raises(ValueError, match="`tokenizer=`"):
        wrapped.generate_batch([BATCH.prompts[0]], max_new_tokens=4, stop_strings=["."], progress_bar=False)
