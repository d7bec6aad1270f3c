"""``generate(streamer=...)`` calls a transformers streamer as transformers' own ``generate`` does: the same ``put``
calls in the same order (the input rows, then one column of new tokens at a time), then ``end()``, each column
put as soon as every row has committed its token, and never a token past a stop.

Each test records the calls a transformers ``BaseStreamer`` gets from transformers' ``generate`` and from the
wrapper's, on every commit path (draft chains, one draft per step, no speculation with delayed verification, which
makes tokens past a stop and discards them).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from tests.torchspec.conftest import PAD_TOKEN_ID, Batch, tiny_spec
from torchspec import sparsespec

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = tiny_spec("llama", 2)
MAX_NEW_TOKENS = 40
ONE = Batch((9,), seed=4)
TWO = Batch((7, 12), seed=3)
PATHS = [
    pytest.param({}, id="draft-chain"),
    pytest.param({"draft_chain": False}, id="one-draft-per-step"),
    pytest.param({"draft": None}, id="no-speculation-delayed-verify"),
]


class Recorder(BaseStreamer):
    """Records every ``put`` (and the engine steps committed by then, when given a wrapper) and ``end``."""

    def __init__(self, wrapped: Any = None) -> None:
        self.wrapped = wrapped
        self.calls: list[Any] = []
        self.steps: list[int] = []  # engine steps committed at each put

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(value.tolist())
        if self.wrapped is not None:
            self.steps.append(self.wrapped.engine._run_steps)

    def end(self) -> None:
        self.calls.append("end")


class StopAt(StoppingCriteria):
    """Stops the rows whose newest token is ``token`` (row-wise, like ``StopStringCriteria``)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return input_ids[:, -1] == self.token


def _stop_token(batch: Batch, column: int) -> int:
    """The token transformers' greedy first row makes at ``column`` (a stop there ends it early)."""
    with torch.inference_mode():
        greedy = SPEC.build().generate(**batch.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    row = greedy[0, batch.width :].tolist()
    return next(t for t in row[column:] if t != PAD_TOKEN_ID and t not in row[:column])


def _transformers_calls(batch: Batch, stop: dict[str, Any], **kwargs: Any) -> tuple[list[Any], torch.Tensor]:
    recorder = Recorder()
    with torch.inference_mode():
        output = SPEC.build().generate(
            **batch.kwargs(), max_new_tokens=MAX_NEW_TOKENS, streamer=recorder, **stop, **kwargs
        )
    return recorder.calls, output


@pytest.mark.parametrize("stop_kind", ["eos", "criterion"])
@pytest.mark.parametrize("options", PATHS)
def test_one_row_streams_as_transformers(options: dict[str, Any], stop_kind: str) -> None:
    """Batch 1, stopped mid-way by an EOS id or a stopping criterion: the prompt, then each returned token in its
    own put, then ``end()``, exactly transformers' calls; the tokens go out over the run's steps, not at its end."""
    token = _stop_token(ONE, column=12)
    stop = (
        {"eos_token_id": token} if stop_kind == "eos" else {"stopping_criteria": StoppingCriteriaList([StopAt(token)])}
    )
    expected, reference = _transformers_calls(ONE, stop, do_sample=False)
    assert reference.shape[1] < ONE.width + MAX_NEW_TOKENS, "the stop did not end the row early: test is vacuous"
    wrapped = sparsespec.wrap(SPEC.build(), kv_capacity_tokens=1024, **options)
    recorder = Recorder(wrapped)
    output = wrapped.generate(**ONE.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, streamer=recorder, **stop)
    assert torch.equal(output, reference)
    assert recorder.calls == expected
    assert recorder.calls[1:-1] == [[token] for token in output[0, ONE.width :].tolist()]
    assert recorder.steps[1] < recorder.steps[-1] == wrapped.last_stats.steps, "tokens were not put as committed"


@pytest.mark.parametrize("options", PATHS)
def test_batch_and_samples_stream_columns_as_transformers(options: dict[str, Any]) -> None:
    """Two prompts x two samples (every sample greedy: ``top_k=1``), an EOS ending some rows: the expanded input
    rows, then one ``[4]`` column per new token (a finished row's is the pad id), as transformers puts them."""
    eos = _stop_token(TWO, column=6)
    sampling = {"do_sample": True, "top_k": 1, "num_return_sequences": 2}
    expected, reference = _transformers_calls(TWO, {"eos_token_id": eos}, **sampling)
    assert any(row[-1] == PAD_TOKEN_ID for row in reference.tolist()), "no row stopped early: test is vacuous"
    wrapped = sparsespec.wrap(SPEC.build(), kv_capacity_tokens=1024, **options)
    recorder = Recorder(wrapped)
    output = wrapped.generate(
        **TWO.kwargs(), max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, streamer=recorder, **sampling
    )
    assert torch.equal(output, reference)
    assert recorder.calls == expected
    assert recorder.calls[1:-1] == output[:, TWO.width :].T.tolist()


class Tokenizer:
    """What ``TextStreamer`` reads of a tokenizer: ``decode`` (each token as its id and a space)."""

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return "".join(f"{token} " for token in token_ids)


def test_text_iterator_streamer() -> None:
    """transformers' ``TextIteratorStreamer`` yields the new tokens' text; given a batch it refuses it with its
    own error, as it does in transformers' ``generate``."""
    wrapped = sparsespec.wrap(SPEC.build(), kv_capacity_tokens=1024)
    streamer = TextIteratorStreamer(Tokenizer(), skip_prompt=True, timeout=5)
    output = wrapped.generate(**ONE.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, streamer=streamer)
    assert "".join(streamer) == Tokenizer().decode(output[0, ONE.width :].tolist())
    for model in (SPEC.build(), wrapped):
        with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"), torch.inference_mode():
            model.generate(
                **TWO.kwargs(), max_new_tokens=4, do_sample=False, streamer=TextIteratorStreamer(Tokenizer())
            )


def test_generate_batch_and_stream_take_no_streamer() -> None:
    """Like transformers' continuous batching, ``generate_batch`` streams nothing, and ``stream`` is a stream
    itself: a streamer given to either is refused by name."""
    wrapped = sparsespec.wrap(SPEC.build(), kv_capacity_tokens=1024, draft=None)
    with pytest.raises(ValueError, match=r"unsupported generate argument.*streamer"):
        wrapped.generate_batch(ONE.prompts, max_new_tokens=4, streamer=Recorder())
    with pytest.raises(ValueError, match=r"unsupported generate argument.*streamer"):
        next(wrapped.stream(ONE.prompts[0], max_new_tokens=4, streamer=Recorder()))
