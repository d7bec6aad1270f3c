"""``num_return_sequences=n``: n samples per prompt in transformers' layout, the prompt prefilled once.

transformers refuses n > 1 with greedy decoding, so the deterministic tests sample with ``top_k=1`` (every sample is
the greedy continuation): the output must equal transformers' own, row for row and padding included, and each
prompt's K/V must have been computed once, its other samples copying it and computing only the prompt's last k + 1
tokens. Sampled runs must give samples that differ and that each continue their prompt (every token among the
model's top-k there). ``generate_batch`` keys the samples as transformers' continuous batching does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from tests.torchspec.conftest import (
    PAD_TOKEN_ID,
    Batch,
    assert_no_slot_leak,
    assert_same_tokens,
    small_continuous_batching,
    tiny_spec,
)
from torchspec import sparsespec
from torchspec.step import Phase

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = tiny_spec("llama", 2)
BATCH = Batch((5, 11, 19, 30), seed=2)
SAMPLES = 3
MAX_NEW_TOKENS = 24
GREEDY_SAMPLING = {"do_sample": True, "top_k": 1}  # transformers refuses n > 1 with do_sample=False
K = 8  # the default draft's round length
PATHS = [
    pytest.param({"draft": None}, 1, id="no-speculation-delayed-verify"),
    pytest.param({}, K + 1, id="default-draft"),
    pytest.param({"delayed_verify": True}, K + 1, id="default-draft-rounds-ahead"),
    pytest.param({"draft_chain": False, "delayed_verify": True}, K + 1, id="one-draft-per-step-staggered"),
    pytest.param({"draft": None, "max_step_tokens": 8, "delayed_verify": False}, 1, id="chunk8-synchronous"),
    pytest.param({"max_step_tokens": 8, "max_batch_size": 5}, K + 1, id="default-draft-chunk8-batch5"),
]


def _wrap(options: dict[str, Any]) -> Any:
    return sparsespec.wrap(SPEC.build(), **({"kv_capacity_tokens": 2048} | options))


def _count_prefill(wrapped: Any) -> Counter[int]:
    """Prompt tokens computed per prompt of the next ``generate`` calls (its rows' request ids // SAMPLES)."""
    counts: Counter[int] = Counter()
    launch = wrapped.engine.runner.launch

    def counting_launch(plan):
        for item in plan.scheduled:
            if item.phase is Phase.PREFILL:
                counts[item.request.request_id // SAMPLES] += item.num_query_tokens
        return launch(plan)

    wrapped.engine.runner.launch = counting_launch
    return counts


@pytest.fixture(scope="module")
def eos() -> int:
    """An EOS id that ends the first prompt's greedy continuation early (so its rows are padded), not every one."""
    with torch.inference_mode():
        greedy = SPEC.build().generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    first, *others = greedy[:, BATCH.width :].tolist()
    return next(t for t in first[4:] if t != PAD_TOKEN_ID and any(t not in row for row in others))


@pytest.fixture(scope="module")
def reference(eos: int) -> torch.Tensor:
    """transformers' ``generate`` with n samples of every prompt, every sample the greedy continuation."""
    spec = SPEC.with_config(eos_token_id=eos)
    options = {"max_new_tokens": MAX_NEW_TOKENS, "num_return_sequences": SAMPLES} | GREEDY_SAMPLING
    with torch.inference_mode():
        expected = spec.build().generate(**BATCH.kwargs(), **options)
        greedy = spec.build().generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert torch.equal(expected, greedy.repeat_interleave(SAMPLES, dim=0)), "top_k=1 sampling is not greedy"
    ends = expected[:, -1].tolist()
    assert ends[0] == PAD_TOKEN_ID and any(end != PAD_TOKEN_ID for end in ends), "EOS should end some rows only"
    return expected


@pytest.mark.parametrize(("options", "tail"), PATHS)
def test_samples_equal_transformers_and_share_the_prefill(
    options: dict[str, Any], tail: int, eos: int, reference: torch.Tensor
) -> None:
    """Rows grouped per prompt, padded as transformers pads them, equal to its output; each prompt prefilled
    once, its other samples computing only its last ``tail`` (k + 1) tokens (a prompt no longer: all of it)."""
    wrapped = _wrap(options)
    wrapped.hf_model.generation_config.eos_token_id = eos
    prefilled = _count_prefill(wrapped)
    output = wrapped.generate(
        **BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=SAMPLES, **GREEDY_SAMPLING
    )
    assert_same_tokens(reference, output, SPEC, BATCH)
    expected = {p: n + (SAMPLES - 1) * min(n, tail) for p, n in enumerate(BATCH.lengths)}
    assert dict(prefilled) == expected
    assert wrapped.last_stats.num_requests == SAMPLES * len(BATCH.lengths)
    assert_no_slot_leak(wrapped)


def test_samples_survive_offload(reference: torch.Tensor, eos: int) -> None:
    """A pool far below the samples' worst case, with offload: the same tokens, nothing left behind. (This schedule
    moves samples out while they wait for their prompt's K/V, and admits samples after their source finished.)"""
    wrapped = _wrap(
        {"draft": None, "kv_capacity_tokens": 80, "max_batch_size": 6, "max_step_tokens": 4, "offload": True}
    )
    wrapped.hf_model.generation_config.eos_token_id = eos
    output = wrapped.generate(
        **BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=SAMPLES, **GREEDY_SAMPLING
    )
    assert_same_tokens(reference, output, SPEC, BATCH)
    assert wrapped.last_stats.offload.offloaded_tokens > 0, "nothing moved: the pool was not a limit"
    assert_no_slot_leak(wrapped)
    assert wrapped.engine.runner.host.num_requests == 0


def test_penalised_samples_equal_transformers() -> None:
    """A repetition penalty holds in every sample of a prompt: the samples that copy its K/V penalise the prompt's
    tokens and their own as transformers does, and the prompt is still prefilled once."""
    options = {"max_new_tokens": MAX_NEW_TOKENS, "num_return_sequences": SAMPLES} | GREEDY_SAMPLING
    with torch.inference_mode():
        expected = SPEC.build().generate(**BATCH.kwargs(), **options, repetition_penalty=1.3)
        plain = SPEC.build().generate(**BATCH.kwargs(), **options)
    assert not torch.equal(expected, plain), "the penalty does not change transformers' output: test is vacuous"
    wrapped = _wrap({})
    prefilled = _count_prefill(wrapped)
    assert_same_tokens(expected, wrapped.generate(**BATCH.kwargs(), **options, repetition_penalty=1.3), SPEC, BATCH)
    assert dict(prefilled) == {p: n + (SAMPLES - 1) * min(n, K + 1) for p, n in enumerate(BATCH.lengths)}
    assert_no_slot_leak(wrapped)


def _top_k_rank_ok(model: Any, sequences: torch.Tensor, batch: Batch, top_k: int) -> bool:
    """Every generated token of every row is among the model's ``top_k`` at its position (transformers' forward
    of the row with its left padding masked)."""
    _, attention_mask = batch.tensors()
    mask = torch.cat(
        [attention_mask.repeat_interleave(SAMPLES, dim=0), torch.ones_like(sequences[:, batch.width :])], dim=1
    )
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
    allowed = logits[:, batch.width - 1 : -1].topk(top_k, dim=-1).indices
    return bool((allowed == sequences[:, batch.width :, None]).any(-1).all())


@pytest.mark.parametrize("options", [{"draft": None}, {}], ids=["no-speculation", "default-draft"])
def test_sampled_samples_differ_and_continue_their_prompt(options: dict[str, Any]) -> None:
    """Each sample draws its own tokens (a prompt's rows differ) and each is a continuation of its own prompt
    under the copied K/V: every token is among transformers' top 5 for the row so far."""
    wrapped = _wrap(options)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        output = wrapped.generate(
            **BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=SAMPLES, do_sample=True, top_k=5
        )
    assert output.shape == (SAMPLES * len(BATCH.lengths), BATCH.width + MAX_NEW_TOKENS)
    assert torch.equal(output[:, : BATCH.width], BATCH.tensors()[0].repeat_interleave(SAMPLES, dim=0))
    for prompt in range(len(BATCH.lengths)):
        rows = {tuple(row) for row in output[prompt * SAMPLES : (prompt + 1) * SAMPLES, BATCH.width :].tolist()}
        assert len(rows) == SAMPLES, f"prompt {prompt}: samples repeat each other"
    assert _top_k_rank_ok(SPEC.build(), output, BATCH, top_k=5)
    assert not _top_k_rank_ok(SPEC.build(), output, BATCH, top_k=1), "top-5 check is vacuous"
    assert_no_slot_leak(wrapped)


SMALL_CB = small_continuous_batching()


def test_generate_batch_keys_samples_as_transformers() -> None:
    """transformers' ``generate_batch`` names a prompt's samples ``req_i__child#j`` then ``req_i``; the wrapper's
    result has the same keys in the same order and the same tokens, each sample's ``index`` its prompt's."""
    options = {"max_new_tokens": MAX_NEW_TOKENS, "num_return_sequences": SAMPLES} | GREEDY_SAMPLING
    prompts = BATCH.prompts[:3]
    with torch.inference_mode():  # a config of its own: transformers' sets eos_token_id=-1 in the one it is given
        expected = SPEC.build().generate_batch(
            prompts,
            generation_config=GenerationConfig(**options),
            continuous_batching_config=SMALL_CB,
            progress_bar=False,
        )
    wrapped = _wrap({})
    actual = wrapped.generate_batch(prompts, generation_config=GenerationConfig(**options), progress_bar=False)
    assert list(actual) == list(expected)
    assert list(actual)[:3] == ["req_0__child#0", "req_0__child#1", "req_0"]
    assert [o.generated_tokens for o in actual.values()] == [o.generated_tokens for o in expected.values()]
    assert [(o.request_id, o.index) for o in actual.values()] == [(key, int(key[4])) for key in actual]
    assert_no_slot_leak(wrapped)


def test_generate_batch_reports_a_bad_prompt_for_each_sample() -> None:
    """A bad prompt fails each of its samples under their own ids; the other prompt's samples complete."""
    wrapped = _wrap({"draft": None})
    outputs = wrapped.generate_batch([[], BATCH.prompts[0]], max_new_tokens=4, num_return_sequences=2, do_sample=True)
    assert list(outputs) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1"]
    assert [o.finish_reason for o in outputs.values()] == ["error", "error", "length", "length"]
    assert all("empty prompt" in outputs[key].error for key in ("req_0__child#0", "req_0"))
    assert_no_slot_leak(wrapped)


@pytest.mark.parametrize("value", [0, -2, 2.5, 3.0, True])
def test_bad_num_return_sequences_says_what_to_pass(value: Any) -> None:
    wrapped = _wrap({"draft": None})
    with pytest.raises(ValueError, match=r"num_return_sequences must be an integer >= 1.*num_return_sequences=4"):
        wrapped.generate(**BATCH.kwargs(), max_new_tokens=4, do_sample=True, num_return_sequences=value)
    with pytest.raises(ValueError, match="num_return_sequences must be an integer >= 1"):
        wrapped.generate_batch(BATCH.prompts, max_new_tokens=4, do_sample=True, num_return_sequences=value)


def test_options_transformers_refuses_with_samples() -> None:
    """As transformers: greedy decoding with n > 1 is refused with its own message; beam search is refused (not
    implemented); ``stream`` makes one sample and says where to get several."""
    wrapped = _wrap({"draft": None})
    with pytest.raises(ValueError, match=r"Greedy methods .* do not support `num_return_sequences`"):
        wrapped.generate(**BATCH.kwargs(), max_new_tokens=4, do_sample=False, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_beams"):
        wrapped.generate(**BATCH.kwargs(), max_new_tokens=4, num_beams=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="use generate or generate_batch"):
        next(wrapped.stream(BATCH.prompts[0], max_new_tokens=4, do_sample=True, num_return_sequences=2))
