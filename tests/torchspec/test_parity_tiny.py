"""Greedy fp32 parity with transformers' own ``generate`` on tiny random Llama / Mistral / Qwen2 / Qwen3 models.

Every test runs a left-padded batch of prompts of different lengths for 48 new tokens and compares with
``torch.equal``; every test also checks that all KV slots are free again afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching import RequestStatus

from tests.torchspec.conftest import (
    PAD_TOKEN_ID,
    Batch,
    TinyModelSpec,
    assert_no_slot_leak,
    assert_same_tokens,
    generated_rows,
    small_continuous_batching,
    tiny_spec,
)
from torchspec import sparsespec
from torchspec.request import SamplingParams
from torchspec.runner import LaunchedStep
from torchspec.step import StepPlan

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_NEW_TOKENS = 48
# Four prompts; three are longer than the 8-token step budget of the chunked-prefill tests.
BATCH = Batch((5, 11, 19, 30))
KV_CAPACITY = 1024  # plenty: sizing from host memory would only waste time

ARCH_SPECS = [tiny_spec(arch, kv) for arch in ("llama", "mistral", "qwen2", "qwen3") for kv in (2, 4)]
# Multi-query attention. Seed 3: seed 0 has a greedy step whose top-2 logits differ by only 2e-5.
ARCH_SPECS.append(tiny_spec("llama", 1, seed=3))

SLIDING = "sliding_attention"
FULL = "full_attention"
SLIDING_SPECS = [
    tiny_spec("mistral", sliding_window=8),
    tiny_spec("mistral", 4, sliding_window=16),
    tiny_spec("qwen2", use_sliding_window=True, sliding_window=8, layer_types=[SLIDING, FULL]),
    tiny_spec("qwen2", 4, use_sliding_window=True, sliding_window=16, layer_types=[FULL, SLIDING]),
    tiny_spec("qwen3", use_sliding_window=True, sliding_window=8, layer_types=[FULL, SLIDING]),
    tiny_spec("qwen3", 4, use_sliding_window=True, sliding_window=16, layer_types=[SLIDING, FULL]),
]
# One plain and three windowed specs for the scheduling tests (their references are shared with the above).
SCHEDULING_SPECS = [ARCH_SPECS[0], SLIDING_SPECS[0], SLIDING_SPECS[2], SLIDING_SPECS[4]]


def _ids(specs: list[TinyModelSpec]) -> list[str]:
    return [spec.id for spec in specs]


def _expected_windows(spec: TinyModelSpec) -> list[int | None]:
    config = spec.config()
    if spec.arch == "mistral":  # one window for every layer; Mistral ignores layer_types
        return [config.sliding_window] * config.num_hidden_layers
    return [config.sliding_window if kind == SLIDING else None for kind in config.layer_types]


def _without_window(spec: TinyModelSpec) -> TinyModelSpec:
    """The same weights with full attention in every layer."""
    if spec.arch == "mistral":
        return spec.with_config(sliding_window=None)
    return spec.with_config(use_sliding_window=False, layer_types=[FULL, FULL])


class PlanRecorder:
    """Spies on the engine's runner: records each step as ``[(request_id, query_tokens, decode), ...]``."""

    def __init__(self, wrapped: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[list[tuple[int, int, bool]]] = []
        runner = wrapped.engine.runner
        launch = runner.launch

        def spy(plan: StepPlan) -> LaunchedStep:
            self.steps.append(
                [
                    (
                        s.request.request_id,
                        s.num_query_tokens,
                        s.request.num_computed_tokens >= s.request.num_prompt_tokens,
                    )
                    for s in plan.scheduled
                ]
            )
            return launch(plan)

        monkeypatch.setattr(runner, "launch", spy)

    def max_tokens(self) -> int:
        return max(sum(n for _, n, _ in step) for step in self.steps)

    def max_requests(self) -> int:
        return max(len(step) for step in self.steps)

    def mixed_steps(self) -> int:
        """Steps where a prompt chunk shares the forward with another request's decode token."""
        return sum(any(decode for *_, decode in step) and any(not decode for *_, decode in step) for step in self.steps)


def _run(
    spec: TinyModelSpec, batch: Batch, wrap_options: dict[str, Any] | None = None, **generate_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """(wrapper, output) of the engine on a fresh model of ``spec``, greedy, MAX_NEW_TOKENS new tokens."""
    wrapped = sparsespec.wrap(
        spec.build(), **({"kv_capacity_tokens": KV_CAPACITY, "draft": None} | (wrap_options or {}))
    )
    output = wrapped.generate(**batch.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **generate_kwargs)
    return wrapped, output


def _eos_for_some_rows(rows: list[list[int]]) -> int:
    """A token that some rows generate well before the end and some row never generates."""
    candidates = [
        (min(row.index(t) for row in rows if t in row), t)
        for t in {t for row in rows for t in row[: MAX_NEW_TOKENS - 8]}
        if t != PAD_TOKEN_ID and any(t not in row for row in rows)
    ]
    assert candidates, "no token ends only some rows; pick another seed"
    return min(candidates)[1]


def _eos_ending_every_row(rows: list[list[int]]) -> list[int]:
    """One token per row from its early generation, so every row stops well before max_new_tokens."""
    return sorted({next(t for t in row[6 + 3 * i :] if t != PAD_TOKEN_ID) for i, row in enumerate(rows)})


@pytest.fixture
def eos_spec(hf_reference) -> Callable[[TinyModelSpec, Batch], TinyModelSpec]:
    """``eos_spec(spec, batch)``: ``spec`` with an EOS id (in its config) that stops some rows but not all."""

    def make(spec: TinyModelSpec, batch: Batch) -> TinyModelSpec:
        rows = generated_rows(hf_reference(spec, batch, max_new_tokens=MAX_NEW_TOKENS), batch)
        return spec.with_config(eos_token_id=_eos_for_some_rows(rows))

    return make


# -- architectures ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ARCH_SPECS, ids=_ids(ARCH_SPECS))
def test_architecture_matches_transformers(spec, hf_reference):
    """Plain decoding of each architecture, with and without GQA, is token-identical to transformers."""
    expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS)
    wrapped, actual = _run(spec, BATCH)
    assert_same_tokens(expected, actual, spec, BATCH)
    assert actual.shape == (len(BATCH.lengths), BATCH.width + MAX_NEW_TOKENS)
    assert_no_slot_leak(wrapped)
    assert wrapped.hf_model.config._attn_implementation == "sdpa", "the model's own attention was not restored"


# -- sliding windows ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SLIDING_SPECS, ids=_ids(SLIDING_SPECS))
def test_sliding_window_matches_transformers(spec, hf_reference):
    """Windows smaller than prompt + generation (Mistral: every layer; Qwen2/3: per layer via layer_types)."""
    expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS)
    full = hf_reference(_without_window(spec), BATCH, max_new_tokens=MAX_NEW_TOKENS)
    assert not torch.equal(expected, full), "the window does not change transformers' output: test is vacuous"
    wrapped, actual = _run(spec, BATCH)
    assert [layer.sliding_window for layer in wrapped.layers] == _expected_windows(spec)
    assert_same_tokens(expected, actual, spec, BATCH)
    assert_no_slot_leak(wrapped)


# -- chunked prefill and continuous batching ---------------------------------------------------------------
SCHEDULES = [
    pytest.param({"max_step_tokens": 8}, id="chunk8"),
    pytest.param({"max_batch_size": 2}, id="batch2"),
    pytest.param({"max_step_tokens": 8, "max_batch_size": 2}, id="chunk8-batch2"),
    pytest.param({"max_step_tokens": 3, "max_batch_size": 3}, id="chunk3-batch3"),
]


@pytest.mark.parametrize("options", SCHEDULES)
@pytest.mark.parametrize("spec", SCHEDULING_SPECS, ids=_ids(SCHEDULING_SPECS))
def test_chunked_prefill_and_continuous_batching(spec, options, hf_reference, monkeypatch):
    """Prompt chunks mixed with other requests' decode steps, and requests waiting for a batch place,
    give the same tokens as one unchunked batch in transformers."""
    expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS)
    wrapped = sparsespec.wrap(spec.build(), kv_capacity_tokens=KV_CAPACITY, **({"draft": None} | options))
    plans = PlanRecorder(wrapped, monkeypatch)
    actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert_same_tokens(expected, actual, spec, BATCH)
    assert_no_slot_leak(wrapped)
    assert plans.max_tokens() <= options.get("max_step_tokens", 2048)
    assert plans.max_requests() <= options.get("max_batch_size", len(BATCH.lengths))
    if "max_step_tokens" in options:
        assert plans.max_tokens() == options["max_step_tokens"]
        assert plans.mixed_steps() > 0, "no step mixed a prompt chunk with a decode"
    if "max_batch_size" in options:
        assert plans.max_requests() == options["max_batch_size"]


# -- EOS -------------------------------------------------------------------------------------------------
EOS_SPECS = [ARCH_SPECS[0], SLIDING_SPECS[4]]
EOS_SCHEDULES = [
    pytest.param({}, id="one-batch"),
    pytest.param({"max_step_tokens": 8, "max_batch_size": 2}, id="chunk8-batch2"),
]


@pytest.mark.parametrize("options", EOS_SCHEDULES)
@pytest.mark.parametrize("spec", EOS_SPECS, ids=_ids(EOS_SPECS))
def test_eos_stops_some_rows(spec, options, hf_reference, eos_spec):
    """An EOS id in the model config ends some rows early; they are padded with pad_token_id while the
    others run to max_new_tokens (and a finished request's slots go to a waiting one)."""
    spec = eos_spec(spec, BATCH)
    eos = dict(spec.overrides)["eos_token_id"]
    expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS)
    rows = generated_rows(expected, BATCH, [eos])
    stopped = [row[-1] == eos and len(row) < MAX_NEW_TOKENS for row in rows]
    assert any(stopped) and not all(stopped), f"EOS {eos} should stop some rows but not all: {stopped}"
    for row, generated in zip(expected[:, BATCH.width :].tolist(), rows, strict=True):
        assert row[len(generated) :] == [PAD_TOKEN_ID] * (MAX_NEW_TOKENS - len(generated))
    wrapped, actual = _run(spec, BATCH, options)
    assert_same_tokens(expected, actual, spec, BATCH)
    assert_no_slot_leak(wrapped)
    assert wrapped.last_stats.generated_tokens == sum(map(len, rows))


@pytest.mark.parametrize("options", EOS_SCHEDULES)
@pytest.mark.parametrize("spec", EOS_SPECS, ids=_ids(EOS_SPECS))
def test_eos_stops_every_row(spec, options, hf_reference):
    """EOS ids passed to generate (a list) end every row early: the output is shorter than
    prompt + max_new_tokens, exactly as in transformers."""
    batch = Batch((9, 4, 23), seed=1)
    rows = generated_rows(hf_reference(spec, batch, max_new_tokens=MAX_NEW_TOKENS), batch)
    eos = _eos_ending_every_row(rows)
    expected = hf_reference(spec, batch, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    assert expected.shape[1] < batch.width + MAX_NEW_TOKENS
    wrapped, actual = _run(spec, batch, options, eos_token_id=eos)
    assert_same_tokens(expected, actual, spec, batch)
    assert_no_slot_leak(wrapped)
    assert all(row[-1] in eos for row in generated_rows(actual, batch, eos))


# -- repetition penalty and min_p -------------------------------------------------------------------------------
DENSE = {"draft": "pillar_recent"}  # min_budget 128 covers every context: each draft is the target's own forward
# (wrap options, whether every draft is accepted: drafts reading every position, else some are rejected)
PENALTY_DRAFTS = [
    pytest.param({}, None, id="no-draft"),
    pytest.param({"draft": "pillar_recent", "min_budget": 8, "sparsity": 0.1}, False, id="sparse"),
    pytest.param(DENSE, True, id="dense"),
    pytest.param(DENSE | {"draft_chain": False}, True, id="dense-stepwise"),
    pytest.param(DENSE | {"cuda_graphs": True}, True, id="dense-graphs"),
    pytest.param(DENSE | {"delayed_verify": True}, True, id="dense-delayed"),
    pytest.param({"draft": "ngram"}, False, id="ngram"),
]
PENALTY_OPTIONS = [
    pytest.param({"repetition_penalty": 1.3}, id="penalty1.3"),
    pytest.param({"repetition_penalty": 0.7}, id="penalty0.7"),  # below 1: repeats favoured
    pytest.param({"repetition_penalty": 1.3, "min_p": 0.1}, id="penalty1.3-min_p0.1"),  # min_p: greedy ignores it
]


@pytest.mark.parametrize("options", PENALTY_OPTIONS)
@pytest.mark.parametrize(("draft", "all_accepted"), PENALTY_DRAFTS)
def test_repetition_penalty_matches_transformers(draft, all_accepted, options, hf_reference):
    """A repetition penalty penalises the prompt and every token so far, as transformers does, whatever drafts:
    with a draft reading every position (chained, one per step, from the chain's padded graph path, or launched
    ahead of the round in flight) every draft is accepted, so each draft forward penalised what its verify row
    did (the round's earlier drafts included)."""
    spec = ARCH_SPECS[0]
    expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS, **options)
    plain = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS)
    assert not torch.equal(expected, plain), "the penalty does not change transformers' output: test is vacuous"
    wrapped, actual = _run(spec, BATCH, draft, **options)
    assert_same_tokens(expected, actual, spec, BATCH)
    assert_no_slot_leak(wrapped)
    stats = wrapped.last_stats
    if all_accepted is not None:
        assert stats.num_draft_tokens > 0
        assert (stats.num_accepted_tokens == stats.num_draft_tokens) is all_accepted, stats.accepted_histogram


def test_per_request_penalties_match_transformers(hf_reference):
    """Requests of one batch with their own penalties each get transformers' tokens for their own value."""
    spec, penalties = ARCH_SPECS[0], (1.3, 1.0, 0.7, 2.0)
    wrapped = sparsespec.wrap(spec.build(), kv_capacity_tokens=KV_CAPACITY)
    requests = [
        wrapped.engine.new_request(i, prompt, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, repetition_penalty=value))
        for i, (prompt, value) in enumerate(zip(BATCH.prompts, penalties, strict=True))
    ]
    stats = wrapped.engine.run(requests)
    for i, (request, value) in enumerate(zip(requests, penalties, strict=True)):
        expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS, repetition_penalty=value)
        assert request.output_ids == generated_rows(expected, BATCH)[i], f"request {i} (penalty {value})"
    assert stats.num_rounds > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert_no_slot_leak(wrapped)


# -- KV capacity ---------------------------------------------------------------------------------------------
LARGEST_NEED = BATCH.width + MAX_NEW_TOKENS
TOTAL_NEED = sum(BATCH.lengths) + len(BATCH.lengths) * MAX_NEW_TOKENS


@pytest.mark.parametrize("capacity", [LARGEST_NEED, 150], ids=["largest-request", "two-requests"])
@pytest.mark.parametrize("spec", SCHEDULING_SPECS[::2], ids=_ids(SCHEDULING_SPECS[::2]))
def test_kv_capacity_below_batch_need(spec, capacity, hf_reference, monkeypatch):
    """A pool smaller than the whole batch's worst case (but holding the largest request) makes requests
    wait for slots instead of failing; output unchanged, no slot leaked, and the pool is reusable."""
    assert LARGEST_NEED <= capacity < TOTAL_NEED
    expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS)
    wrapped = sparsespec.wrap(spec.build(), draft=None, kv_capacity_tokens=capacity)
    plans = PlanRecorder(wrapped, monkeypatch)
    for _ in range(2):  # the second call reuses slots written by the first
        actual = wrapped.generate(**BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert_same_tokens(expected, actual, spec, BATCH)
        assert_no_slot_leak(wrapped)
    assert wrapped.engine.pool.num_slots == capacity
    assert plans.max_requests() < len(BATCH.lengths), "every request ran at once: the pool was not a limit"


# -- return_dict_in_generate ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [ARCH_SPECS[0], SLIDING_SPECS[2]], ids=_ids([ARCH_SPECS[0], SLIDING_SPECS[2]]))
def test_return_dict_in_generate(spec, hf_reference):
    """``return_dict_in_generate=True`` returns an output object whose ``sequences`` is the tensor output."""
    expected = hf_reference(spec, BATCH, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
    wrapped, tensor_output = _run(spec, BATCH)
    output = wrapped.generate(
        **BATCH.kwargs(), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_dict_in_generate=True
    )
    assert not isinstance(output, torch.Tensor)
    assert torch.equal(output.sequences, tensor_output)
    assert_same_tokens(expected, output.sequences, spec, BATCH)
    assert_no_slot_leak(wrapped)


# -- generate_batch ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", EOS_SCHEDULES)
@pytest.mark.parametrize("spec", EOS_SPECS, ids=_ids(EOS_SPECS))
def test_generate_batch_matches_padded_generate(spec, options, hf_reference, eos_spec):
    """Unpadded token-id prompts of different lengths: per-request outputs in input order, equal to each
    row of transformers' padded batch, with finish reasons and call statistics."""
    batch = Batch((19, 5, 30, 11), seed=2)
    spec = eos_spec(spec, batch)
    eos = dict(spec.overrides)["eos_token_id"]
    expected_rows = generated_rows(hf_reference(spec, batch, max_new_tokens=MAX_NEW_TOKENS), batch, [eos])
    wrapped = sparsespec.wrap(spec.build(), kv_capacity_tokens=KV_CAPACITY, **({"draft": None} | options))
    outputs = wrapped.generate_batch(
        batch.prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, progress_bar=False
    ).values()
    assert [o.index for o in outputs] == list(range(len(batch.lengths)))
    assert [o.prompt_ids for o in outputs] == batch.prompts
    assert [o.token_ids for o in outputs] == expected_rows
    reasons = ["stop" if row[-1] == eos else "length" for row in expected_rows]
    assert [o.finish_reason for o in outputs] == reasons
    assert set(reasons) == {"stop", "length"}
    assert all(o.error is None and o.text is None for o in outputs)
    assert [o.stats.generated_tokens for o in outputs] == [len(row) for row in expected_rows]
    assert [o.stats.prompt_tokens for o in outputs] == list(batch.lengths)
    stats = wrapped.last_stats
    assert stats.num_requests == len(batch.lengths)
    assert stats.num_failed == 0
    assert stats.prompt_tokens == sum(batch.lengths)
    assert stats.generated_tokens == sum(map(len, expected_rows))
    assert stats.steps > 0
    assert_no_slot_leak(wrapped)


SMALL_CB = small_continuous_batching()
CB_BATCH = Batch((5, 11, 19), seed=2)


def _client(model: Any, prompts: list[list[int]]) -> tuple[list[str], list[list[int]]]:
    """A client written for transformers' ``generate_batch``, as TRL's rollouts call and read it."""
    outputs = model.generate_batch(
        prompts,
        generation_config=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False),
        continuous_batching_config=SMALL_CB,
        progress_bar=False,
    )
    return list(outputs), [output.generated_tokens for output in outputs.values()]


@pytest.fixture(scope="module")
def transformers_cb() -> tuple[list[str], list[list[int]]]:
    """transformers' own ``generate_batch`` on the tiny Llama: request ids and generated tokens."""
    with torch.inference_mode():
        return _client(tiny_spec("llama").build(), CB_BATCH.prompts)


def test_generate_batch_runs_transformers_clients_unchanged(transformers_cb):
    """Code written for transformers' ``generate_batch`` runs on the wrapper (speculation on) and reads the
    same request ids, in input order, and the same greedy tokens; each output keeps torchspec's fields."""
    wrapped = sparsespec.wrap(tiny_spec("llama").build(), kv_capacity_tokens=KV_CAPACITY)
    assert _client(wrapped, CB_BATCH.prompts) == transformers_cb
    assert transformers_cb[0] == ["req_0", "req_1", "req_2"]
    outputs = wrapped.generate_batch(CB_BATCH.prompts, max_new_tokens=MAX_NEW_TOKENS, progress_bar=False)
    for position, (request_id, output) in enumerate(outputs.items()):
        assert output.request_id == request_id and output.index == position
        assert output.generated_tokens == output.token_ids == transformers_cb[1][position]
        assert output.prompt_ids == CB_BATCH.prompts[position]
        assert output.error is None and output.status == RequestStatus.FINISHED and output.is_finished()
        assert output.finish_reason == "length" and output.timestamps is None
    assert_no_slot_leak(wrapped)


def test_generate_batch_reports_a_bad_prompt_under_its_request_id(transformers_cb):
    """A bad prompt among good ones fails alone, under its own request id (transformers' FAILED status and
    error), and the others complete with transformers' tokens."""
    wrapped = sparsespec.wrap(tiny_spec("llama").build(), draft=None, kv_capacity_tokens=KV_CAPACITY)
    first, second, third = CB_BATCH.prompts
    outputs = wrapped.generate_batch([first, [], second, third], max_new_tokens=MAX_NEW_TOKENS, progress_bar=False)
    assert list(outputs) == ["req_0", "req_1", "req_2", "req_3"]
    failed = outputs["req_1"]
    assert failed.status == RequestStatus.FAILED and failed.is_finished() and "empty prompt" in failed.error
    assert failed.generated_tokens == [] and failed.finish_reason == "error"
    good = [outputs[request_id] for request_id in ("req_0", "req_2", "req_3")]
    assert [o.generated_tokens for o in good] == transformers_cb[1]
    assert all(o.error is None and o.status == RequestStatus.FINISHED for o in good)
    assert_no_slot_leak(wrapped)


def test_a_config_with_eos_minus_one_generates(transformers_cb):
    """transformers' ``generate_batch`` writes ``eos_token_id=-1`` ("no EOS") into a config that has none; a client
    passing that config on (or a list holding -1) generates on the wrapper, with speculation and sampling, and
    never stops at -1: transformers' greedy tokens, every row to ``max_new_tokens``."""
    config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    with torch.inference_mode():
        tiny_spec("llama").build().generate_batch(
            CB_BATCH.prompts[:1], generation_config=config, continuous_batching_config=SMALL_CB, progress_bar=False
        )
    assert config.eos_token_id == -1, "transformers no longer writes -1: this test no longer shows the case"
    wrapped = sparsespec.wrap(tiny_spec("llama").build(), kv_capacity_tokens=KV_CAPACITY)
    outputs = wrapped.generate_batch(CB_BATCH.prompts, generation_config=config, progress_bar=False)
    assert [o.generated_tokens for o in outputs.values()] == transformers_cb[1]
    sequences = wrapped.generate(**CB_BATCH.kwargs(), generation_config=config, eos_token_id=[-1])
    assert generated_rows(sequences, CB_BATCH) == transformers_cb[1]
    sampled = wrapped.generate_batch(CB_BATCH.prompts, generation_config=config, do_sample=True, progress_bar=False)
    assert all(o.finish_reason == "length" for o in sampled.values())
    assert_no_slot_leak(wrapped)
