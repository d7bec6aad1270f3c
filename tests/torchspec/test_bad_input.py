"""Bad input gets a clear error naming the problem, never a crash deep in the engine or a silent wrong answer.

``generate`` raises ``ValueError`` for the whole call (naming the batch row); ``generate_batch`` reports a bad
prompt in its own output (``finish_reason="error"``) while the other prompts complete exactly as they would
alone; ``wrap`` refuses bad options and models whose attention it cannot route. No error leaks KV slots.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    BartForConditionalGeneration,
    BloomConfig,
    ContinuousBatchingConfig,
    Gemma2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

from torchspec import SpecConfig, causal_lm, sparsespec
from torchspec.request import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB_SIZE = 128
CONTEXT = 64  # max_position_embeddings
EOS = 5
PAD = 0
KV_CAPACITY = 256
MAX_NEW_TOKENS = 8


def _prompt(length: int, seed: int = 0) -> list[int]:
    """Random token ids in [6, vocab): no pad, bos or eos inside a prompt."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(EOS + 1, VOCAB_SIZE, (length,), generator=generator).tolist()


def _left_padded(prompts: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` of a left-padded batch (an empty prompt is an all-padding row)."""
    width = max(1, *(len(p) for p in prompts))
    input_ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _assert_no_slot_leak(wrapped: Any) -> None:
    pool = wrapped.engine.pool
    assert pool.allocator.num_free == pool.num_slots, f"{pool.num_slots - pool.allocator.num_free} KV slots leaked"


def _batch_error(wrapped: Any, prompts: list, **kwargs: Any) -> str:
    """The message a call-wide bad option gets from generate_batch: raised as ValueError, or reported on every
    output (both are clear; which one is the library's choice)."""
    try:
        outputs = list(wrapped.generate_batch(prompts, progress_bar=False, **kwargs).values())
    except ValueError as error:
        return str(error)
    assert all(o.finish_reason == "error" and o.error for o in outputs), [(o.finish_reason, o.error) for o in outputs]
    return outputs[0].error


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    """A tiny random Llama (fp32, eval); the global RNG is left untouched."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        initializer_range=0.2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def model(hf_model: torch.nn.Module) -> Iterator[Any]:
    """The wrapped tiny model; after the test, every KV slot must be free again."""
    wrapped = sparsespec.wrap(hf_model, draft=None, kv_capacity_tokens=KV_CAPACITY)
    yield wrapped
    _assert_no_slot_leak(wrapped)


# -- bad prompts -------------------------------------------------------------------------------------------------

BAD_PROMPTS = [
    pytest.param([], r"empty prompt", id="empty"),
    pytest.param(
        _prompt(CONTEXT + 1),
        rf"prompt of {CONTEXT + 1} tokens is longer than the model's context of {CONTEXT}",
        id="long",
    ),
    pytest.param([7, VOCAB_SIZE, 9], rf"token ids \[{VOCAB_SIZE}\] are outside the vocabulary", id="id>=vocab"),
    pytest.param([7, -1, 9], r"token ids \[-1\] are outside the vocabulary", id="negative-id"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_PROMPTS)
def test_generate_rejects_bad_row(model: Any, bad: list[int], message: str) -> None:
    """generate refuses a batch with a bad row before running anything, naming the row and the problem."""
    with pytest.raises(ValueError, match=r"batch row 1: " + message):
        model.generate(**_left_padded([_prompt(5), bad]), max_new_tokens=MAX_NEW_TOKENS)


@pytest.mark.parametrize(("bad", "message"), BAD_PROMPTS)
def test_generate_batch_reports_bad_prompt(model: Any, bad: list[int], message: str) -> None:
    """generate_batch reports a bad prompt in its own output and still answers the good one."""
    good, failed = model.generate_batch([_prompt(5), bad], max_new_tokens=MAX_NEW_TOKENS, progress_bar=False).values()
    assert failed.finish_reason == "error" and failed.token_ids == [] and failed.text is None
    assert re.search(message, failed.error), failed.error
    assert good.finish_reason in ("stop", "length") and good.error is None and good.token_ids


def test_progress_keeps_showing_tokens_after_a_request_ends(model: Any, capsys, monkeypatch) -> None:
    """The progress bar's token count keeps moving once a request has ended (a failed one ends at once): tqdm
    redraws on its own only when the finished count moves, so each refresh of the count is drawn."""
    monkeypatch.setattr(causal_lm, "PROGRESS_SECONDS", 0.0)
    model.generate_batch([_prompt(5), [VOCAB_SIZE]], max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS)
    shown = set(re.findall(r"(\d+) tok, [\d.]+ tok/s", capsys.readouterr().err))
    assert len(shown) >= MAX_NEW_TOKENS // 2, shown


@pytest.mark.parametrize("stop", [-1, VOCAB_SIZE], ids=["negative", ">=vocab"])
def test_stop_token_outside_the_vocabulary_fails_its_request_alone(model: Any, stop: int) -> None:
    """A stop token id no token can match (engine API) ends its own request with an error naming it; the other
    request of the batch completes. (``generate``'s negative eos ids mean no EOS, as in transformers.)"""
    engine = model.engine
    good = engine.new_request(0, _prompt(5), SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    bad = engine.new_request(1, _prompt(5), SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(3, stop)))
    collections.deque(engine.steps([good, bad]), maxlen=0)
    assert bad.error == (
        f"stop token ids [{stop}] are outside the vocabulary [0, {VOCAB_SIZE}): no token can match them; drop them "
        "or check the tokenizer"
    )
    assert bad.output_ids == [] and good.error is None and len(good.output_ids) == MAX_NEW_TOKENS


def test_prompt_filling_the_context_is_accepted(model: Any) -> None:
    """The context check is not off by one: a prompt of exactly max_position_embeddings tokens runs."""
    (output,) = model.generate_batch([_prompt(CONTEXT)], max_new_tokens=1, progress_bar=False).values()
    assert output.finish_reason in ("stop", "length") and len(output.token_ids) == 1


def test_request_larger_than_kv_pool(hf_model: torch.nn.Module) -> None:
    """A request that can never fit the KV pool (prompt + max_new_tokens > capacity) is refused up front with
    the numbers and the two ways out, instead of waiting forever for slots; one that fits exactly runs."""
    model = sparsespec.wrap(hf_model, draft=None, kv_capacity_tokens=16)
    message = r"needs up to 17 KV slots \(prompt 10 \+ max_new_tokens 7\) but the pool holds 16.*max_new_tokens.*"
    message += "kv_capacity_tokens"
    with pytest.raises(ValueError, match="batch row 0: the request " + message):
        model.generate(**_left_padded([_prompt(10)]), max_new_tokens=7)
    (output,) = model.generate_batch([_prompt(10)], max_new_tokens=7, progress_bar=False).values()
    assert output.finish_reason == "error" and re.search(message, output.error), output.error
    sequences = model.generate(**_left_padded([_prompt(10)]), max_new_tokens=6, eos_token_id=None)
    assert sequences.shape == (1, 16)
    _assert_no_slot_leak(model)


# -- bad generation options ----------------------------------------------------------------------------------------

BAD_OPTIONS = [
    pytest.param({"max_new_tokens": -1}, r"max_new_tokens.*-1", id="max_new_tokens=-1"),
    pytest.param({"do_sample": True, "temperature": -0.5}, r"temperature.*-0\.5", id="temperature=-0.5"),
    pytest.param({"do_sample": True, "top_p": 0.0}, r"top_p.*0", id="top_p=0"),
    pytest.param({"do_sample": True, "top_p": 1.5}, r"top_p.*1\.5", id="top_p=1.5"),
    pytest.param({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0.*0\.0", id="repetition_penalty=0"),
    pytest.param({"repetition_penalty": -1.2}, r"repetition_penalty must be > 0.*-1\.2", id="repetition_penalty=-1.2"),
    pytest.param({"do_sample": True, "min_p": 1.5}, r"min_p must be in \[0, 1\].*1\.5", id="min_p=1.5"),
    pytest.param({"min_p": -0.1}, r"min_p must be in \[0, 1\].*-0\.1", id="min_p=-0.1"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_generate_rejects_bad_option(model: Any, options: dict, message: str) -> None:
    """An out-of-range length or sampling option raises ValueError naming the option and its value."""
    options = {"max_new_tokens": MAX_NEW_TOKENS, **options}
    with pytest.raises(ValueError, match=message):
        model.generate(**_left_padded([_prompt(5)]), **options)


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_generate_batch_rejects_bad_option(model: Any, options: dict, message: str) -> None:
    """generate_batch names the bad option too (raised, or on every output), and generates nothing."""
    options = {"max_new_tokens": MAX_NEW_TOKENS, **options}
    assert re.search(message, _batch_error(model, [_prompt(5), _prompt(3, seed=1)], **options))


UNSUPPORTED_OPTIONS = [
    pytest.param({"num_beams": 2}, "num_beams: another search", id="num_beams"),
    pytest.param({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size: a logits processor", id="no_repeat_ngram_size"),
    pytest.param({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions", id="attentions"),
    pytest.param({"foo": 1}, "foo", id="unknown-kwarg"),
]


@pytest.mark.parametrize(("options", "name"), UNSUPPORTED_OPTIONS)
def test_unsupported_generate_option_is_refused(model: Any, options: dict, name: str) -> None:
    """Options torchspec does not implement are refused by name, never silently ignored (which would give
    results that differ from transformers' without a word)."""
    with pytest.raises(ValueError, match=re.escape(name)):
        model.generate(**_left_padded([_prompt(5)]), max_new_tokens=MAX_NEW_TOKENS, **dict(options))
    with pytest.raises(ValueError, match=re.escape(name)):
        model.generate_batch([_prompt(5)], max_new_tokens=MAX_NEW_TOKENS, progress_bar=False, **dict(options))
    with pytest.raises(ValueError, match=re.escape(name)):
        next(model.stream(_prompt(5), max_new_tokens=MAX_NEW_TOKENS, **dict(options)))


GENERATE_BATCH_REFUSED = [
    pytest.param({"record_timestamps": True}, "record_timestamps", id="record_timestamps"),
    pytest.param(
        {"continuous_batching_config": ContinuousBatchingConfig(return_logprobs=True)}, "return_logprobs", id="logprobs"
    ),
    pytest.param({"continuous_batching_config": ContinuousBatchingConfig(seed=3)}, "seed", id="seed"),
]


@pytest.mark.parametrize(("options", "name"), GENERATE_BATCH_REFUSED)
def test_generate_batch_refuses_transformers_options_that_change_outputs(model: Any, options: dict, name: str) -> None:
    """transformers' generate_batch arguments that would change what comes back are refused by name; those
    that only size or schedule transformers' own manager are accepted."""
    with pytest.raises(ValueError, match=re.escape(name)):
        model.generate_batch([_prompt(5)], max_new_tokens=MAX_NEW_TOKENS, progress_bar=False, **options)
    (output,) = model.generate_batch(
        [_prompt(5)],
        max_new_tokens=MAX_NEW_TOKENS,
        progress_bar=False,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=4, max_memory_percent=0.5),
        persistent_manager=True,
        warmup=False,
    ).values()
    assert output.error is None and output.finish_reason in ("stop", "length") and output.generated_tokens


# -- malformed calls -----------------------------------------------------------------------------------------------


def test_malformed_generate_calls(model: Any) -> None:
    """generate needs a 2-D input_ids tensor and a mask of the same shape; generate_batch needs a list."""
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(max_new_tokens=2)
    with pytest.raises(ValueError, match="2-D"):
        model.generate(input_ids=torch.tensor(_prompt(5)), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask \(1, 4\) does not match input_ids \(1, 5\)"):
        model.generate(input_ids=torch.tensor([_prompt(5)]), attention_mask=torch.ones(1, 4), max_new_tokens=2)
    for not_a_list in ("a string", torch.tensor([_prompt(5)])):
        with pytest.raises(TypeError, match="list of prompts"):
            model.generate_batch(not_a_list, progress_bar=False)


def test_text_prompt_without_tokenizer(model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text prompt on a wrapper built without a tokenizer (and none stored with the model) says how to fix it:
    pass tokenizer= to wrap, or give token ids."""
    monkeypatch.chdir(tmp_path)  # an empty working directory: nothing to pick up by accident
    (output,) = model.generate_batch(["What is 2+2?"], max_new_tokens=2, progress_bar=False).values()
    assert output.finish_reason == "error" and output.token_ids == []
    assert "needs a tokenizer" in output.error and "tokenizer=" in output.error, output.error
    with pytest.raises(ValueError, match="needs a tokenizer"):
        next(model.stream("What is 2+2?", max_new_tokens=2))


def test_text_prompt_does_not_pick_up_a_tokenizer_from_the_working_directory(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model built in memory has no tokenizer of its own: an unrelated tokenizer that happens to sit in the
    working directory must not be used to encode its prompts."""
    vocabulary = {"[UNK]": 0, "hello": 7, "world": 8}
    backend = Tokenizer(WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    monkeypatch.chdir(tmp_path)
    (output,) = model.generate_batch(["hello world"], max_new_tokens=2, progress_bar=False).values()
    assert model.tokenizer is None
    assert output.finish_reason == "error" and "needs a tokenizer" in (output.error or ""), output


# -- good and bad prompts together ---------------------------------------------------------------------------------


def test_generate_batch_isolates_bad_prompts(hf_model: torch.nn.Module) -> None:
    """Bad prompts mixed into a batch fail alone: each gets its own message, the good ones complete with the
    tokens they get when run alone, and no KV slot leaks. A small pool and batch limit make the good requests
    queue, so admission runs around the failed ones."""
    model = sparsespec.wrap(hf_model, draft=None, kv_capacity_tokens=48, max_batch_size=2)
    max_new_tokens = 16
    good = {0: _prompt(5, seed=1), 2: _prompt(9, seed=2), 8: _prompt(3, seed=3), 9: _prompt(12, seed=4)}
    bad = {
        1: ([], "empty prompt"),
        3: ([7, VOCAB_SIZE], "outside the vocabulary"),
        4: ([-3, 7], "outside the vocabulary"),
        5: (_prompt(40), r"needs up to 56 KV slots .* pool holds 48"),
        6: (_prompt(CONTEXT + 1), "longer than the model's context"),
        7: ("some text", "needs a tokenizer"),
        10: ([7, 8.5], "integer token ids"),
    }
    inputs = [good[i] if i in good else bad[i][0] for i in range(len(good) + len(bad))]

    outputs = list(model.generate_batch(inputs, max_new_tokens=max_new_tokens, progress_bar=False).values())
    stats = model.last_stats
    _assert_no_slot_leak(model)

    assert [o.index for o in outputs] == list(range(len(inputs)))
    assert stats.num_requests == len(inputs) and stats.num_failed == len(bad)
    for index, (_, message) in bad.items():
        output = outputs[index]
        assert output.finish_reason == "error" and output.token_ids == [], (index, output)
        assert output.error and re.search(message, output.error), (index, output.error)
    for index, prompt in good.items():
        (alone,) = model.generate_batch([prompt], max_new_tokens=max_new_tokens, progress_bar=False).values()
        output = outputs[index]
        assert output.error is None and output.finish_reason == alone.finish_reason != "error", (index, output)
        assert output.token_ids == alone.token_ids, index
        assert output.prompt_ids == prompt
    _assert_no_slot_leak(model)


def test_failed_generate_leaves_wrapper_usable(model: Any) -> None:
    """A generate call refused for one bad row leaves the engine clean: the next call gives the same tokens as
    a wrapper that never saw the bad call."""
    batch = _left_padded([_prompt(5), _prompt(7, seed=1)])
    with pytest.raises(ValueError, match="batch row 2"):
        model.generate(**_left_padded([_prompt(5), _prompt(7, seed=1), [VOCAB_SIZE + 3]]), max_new_tokens=4)
    _assert_no_slot_leak(model)
    fresh = sparsespec.wrap(model.hf_model, draft=None, kv_capacity_tokens=KV_CAPACITY)
    expected = fresh.generate(**batch, max_new_tokens=MAX_NEW_TOKENS)
    assert torch.equal(model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS), expected)


# -- wrap() options and unsupported models -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param({"sparsity": 0}, r"sparsity must be in \(0, 1\], got 0", id="sparsity=0"),
        pytest.param({"sparsity": 1.5}, r"sparsity must be in \(0, 1\], got 1\.5", id="sparsity=1.5"),
        pytest.param({"k": 0}, r"k must be an integer >= 1, got 0", id="k=0"),
        pytest.param({"min_budget": 0}, r"min_budget must be an integer >= 1, got 0", id="min_budget=0"),
        pytest.param({"kv_capacity_tokens": 0}, r"kv_capacity_tokens .* got 0", id="kv_capacity_tokens=0"),
        pytest.param({"max_batch_size": 0}, r"max_batch_size .* got 0", id="max_batch_size=0"),
        pytest.param({"draft": "nosuch"}, r"unknown draft policy 'nosuch'", id="draft=nosuch"),
        pytest.param({"foo": 1}, r"unknown SpecConfig option\(s\) \['foo'\]", id="foo=1"),
    ],
)
def test_wrap_rejects_bad_option(hf_model: torch.nn.Module, options: dict, message: str) -> None:
    """wrap() validates its options up front and names the bad one (an unknown one with the valid list)."""
    with pytest.raises(ValueError, match=message):
        sparsespec.wrap(hf_model, **options)


def test_wrap_rejects_config_and_options_together(hf_model: torch.nn.Module) -> None:
    """A SpecConfig and loose options at once are ambiguous: refused rather than one silently winning."""
    with pytest.raises(ValueError, match="not both"):
        sparsespec.wrap(hf_model, config=SpecConfig(), max_batch_size=4)


def _unsupported_models() -> list[Any]:
    bloom = BloomConfig(vocab_size=VOCAB_SIZE, hidden_size=64, n_layer=2, n_head=4)
    gemma2 = Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=CONTEXT,
    )
    bart = BartConfig(
        vocab_size=VOCAB_SIZE,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=CONTEXT,
    )
    return [
        # No AttentionInterface support at all (no `_supports_attention_backend`).
        pytest.param(lambda: AutoModelForCausalLM.from_config(bloom), "does not route attention", id="bloom"),
        # Supports the interface, but its layers pass logit soft-capping, which paged attention does not do.
        pytest.param(lambda: AutoModelForCausalLM.from_config(gemma2), r"\['softcap'\]", id="gemma2-softcap"),
        pytest.param(lambda: BartForConditionalGeneration(bart), "encoder-decoder", id="bart"),
    ]


@pytest.mark.parametrize(("build", "reason"), _unsupported_models())
def test_wrap_refuses_unroutable_model(build: Any, reason: str) -> None:
    """A model whose attention cannot be routed is refused at wrap() with a ValueError naming the model class
    and the reason, and is left as it was (its own attention implementation restored, still runnable)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = build().eval()
    implementation = hf.config._attn_implementation
    with pytest.raises(ValueError, match=reason) as info:
        sparsespec.wrap(hf)
    assert type(hf).__name__ in str(info.value)
    assert hf.config._attn_implementation == implementation
    if not hf.config.is_encoder_decoder:
        with torch.inference_mode():
            assert hf(input_ids=torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, VOCAB_SIZE)
