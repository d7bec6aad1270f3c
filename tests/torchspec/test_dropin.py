"""The wrapper is the model to the clients people already run: transformers' text-generation pipeline gives the
plain model's answers through torchspec's engine, and every attribute a client reads (``can_generate``, ``dtype``,
``save_pretrained``, gradient checkpointing, the weights themselves, ...) is the wrapped model's own.

The session's SmolLM2 is shared with other tests: every test that changes it puts it back.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList, pipeline
from transformers.utils import logging as hf_logging

from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import SparseSpecForCausalLM, sparsespec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a primary colour."}],
]
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def wrapped(smollm2: tuple[Any, Any]) -> SparseSpecForCausalLM:
    """SmolLM2 wrapped with the default options (speculation on), a pool for two requests."""
    model, tokenizer = smollm2
    return sparsespec.wrap(model, tokenizer=tokenizer, max_batch_size=len(CHATS))


@pytest.fixture
def propagated_logs() -> Iterator[None]:
    """transformers' log records reach pytest's caplog (its root logger does not propagate by default)."""
    hf_logging.enable_propagation()
    yield
    hf_logging.disable_propagation()


# -- transformers' pipeline ----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("propagated_logs")
def test_text_generation_pipeline_matches_the_plain_model(
    smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM, caplog: pytest.LogCaptureFixture
) -> None:
    """Chat, batch 2, greedy: the wrapped model's pipeline answers as the plain model's does, the tokens come
    from torchspec's engine, and the pipeline takes the wrapper for a supported causal LM (no error logged)."""
    model, tokenizer = smollm2
    options = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "batch_size": len(CHATS)}
    expected = pipeline("text-generation", model=model, tokenizer=tokenizer)(CHATS, **options)
    wrapped.last_stats = type(wrapped.last_stats)()
    with caplog.at_level("ERROR", logger="transformers"):
        actual = pipeline("text-generation", model=wrapped, tokenizer=tokenizer)(CHATS, **options)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert actual == expected
    answers = [output[0]["generated_text"][-1] for output in actual]
    assert all(a["role"] == "assistant" and a["content"] for a in answers), answers
    assert wrapped.last_stats.num_requests == len(CHATS), "the pipeline did not generate on torchspec's engine"


def test_pipeline_returns_num_return_sequences_samples(
    smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM
) -> None:
    """Chat, batch 2, sampled with ``num_return_sequences=3``: the pipeline gets three different answers per chat
    from torchspec's engine (the rows in transformers' layout, which the pipeline regroups per prompt)."""
    _, tokenizer = smollm2
    options = {"max_new_tokens": 8, "do_sample": True, "num_return_sequences": 3, "batch_size": len(CHATS)}
    wrapped.last_stats = type(wrapped.last_stats)()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        outputs = pipeline("text-generation", model=wrapped, tokenizer=tokenizer)(CHATS, **options)
    assert [len(samples) for samples in outputs] == [3] * len(CHATS)
    for chat, samples in zip(CHATS, outputs, strict=True):
        assert all(sample["generated_text"][: len(chat)] == chat for sample in samples)
        answers = {sample["generated_text"][-1]["content"] for sample in samples}
        assert len(answers) == 3, answers
    assert wrapped.last_stats.num_requests == 3 * len(CHATS), "the pipeline did not generate on torchspec's engine"


def test_generate_accepts_options_that_ask_for_nothing(
    smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM
) -> None:
    """Clients pass unsupported options with values that ask for nothing (a pipeline's ``streamer=None``, a
    trainer's ``synced_gpus=False``, lm-eval's ``use_cache``, an empty criteria list, no stop strings and the
    tokenizer that would decode them): the answer is the one without them. The same options asking for something
    are refused by name."""
    _, tokenizer = smollm2
    batch = tokenizer(["The capital of France is"], return_tensors="pt")
    expected = wrapped.generate(**batch, max_new_tokens=4, do_sample=False)
    neutral = {
        "streamer": None,
        "synced_gpus": False,
        "use_cache": True,
        "stopping_criteria": StoppingCriteriaList(),
        "logits_processor": LogitsProcessorList(),
        "stop_strings": None,
        "tokenizer": tokenizer,
        "num_return_sequences": 1,
        "generation_config": copy.deepcopy(wrapped.generation_config),
    }
    assert torch.equal(wrapped.generate(**batch, max_new_tokens=4, do_sample=False, **neutral), expected)
    with pytest.raises(ValueError, match="`logits_processor` is not supported"):
        wrapped.generate(**batch, max_new_tokens=4, logits_processor=LogitsProcessorList([lambda ids, scores: scores]))
    with pytest.raises(ValueError, match="`synced_gpus` is not supported"):
        wrapped.generate(**batch, max_new_tokens=4, synced_gpus=True)


# -- the model's attributes ----------------------------------------------------------------------------------------
def test_wrapper_passes_for_the_model(smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM) -> None:
    """What pipelines, lm-eval and trainers read is the model's own; torchspec's ``generate`` is not."""
    model, _ = smollm2
    assert type(wrapped) is SparseSpecForCausalLM
    assert isinstance(wrapped, PreTrainedModel) and isinstance(wrapped, type(model))
    assert wrapped.__class__.__name__ == type(model).__name__ == "LlamaForCausalLM"
    assert wrapped.can_generate()
    assert wrapped.dtype == model.dtype == torch.float32
    assert wrapped.device == model.device
    assert wrapped.num_parameters() == model.num_parameters() > 0
    assert wrapped.config is model.config and wrapped.generation_config is model.generation_config
    assert wrapped.input_modalities == model.input_modalities
    assert wrapped.base_model is model.model and wrapped.model is model.model
    assert wrapped.get_output_embeddings() is model.get_output_embeddings() is model.lm_head
    assert wrapped.get_input_embeddings() is model.get_input_embeddings()
    assert wrapped.generate.__func__ is SparseSpecForCausalLM.generate
    assert "save_pretrained" in dir(wrapped) and "generate_batch" in dir(wrapped)


def test_assignments_reach_the_model(smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM) -> None:
    """An attribute of the model's assigned through the wrapper is assigned on the model (so the model's own
    methods, and generate's defaults, see it); torchspec's own attributes stay on the wrapper."""
    model, _ = smollm2
    original = model.generation_config
    replacement = copy.deepcopy(original)
    try:
        wrapped.generation_config = replacement
        assert model.generation_config is replacement and wrapped.generation_config is replacement
    finally:
        model.generation_config = original
    wrapped.tokenizer = wrapped.tokenizer
    assert "tokenizer" not in vars(model)


def test_weights_are_shared_by_reference(smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM) -> None:
    """Same parameter objects under the same names, same state_dict; a weight changed in the model changes
    what the wrapper generates (here a zero final norm makes every logit 0, so greedy picks token 0)."""
    model, tokenizer = smollm2
    assert [(n, id(p)) for n, p in wrapped.named_parameters()] == [(n, id(p)) for n, p in model.named_parameters()]
    state, model_state = wrapped.state_dict(), model.state_dict()
    assert list(state) == list(model_state)
    assert all(state[name].data_ptr() == model_state[name].data_ptr() for name in state)
    batch = tokenizer(["The capital of France is"], return_tensors="pt")
    norm = model.model.norm.weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm.zero_()
        zeros = wrapped.generate(**batch, max_new_tokens=3, do_sample=False)[0, batch["input_ids"].shape[1] :]
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    assert zeros.tolist() == [0, 0, 0]


def test_module_methods_are_the_models(smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM) -> None:
    """train/eval switch the model and return the wrapper; every nn.Module method transformers redefines runs
    the model's version through the wrapper; tie_weights keeps the head tied to the embeddings."""
    model, _ = smollm2
    redefined = {
        name
        for name in dir(torch.nn.Module)
        if not name.startswith("_")
        and name != "forward"
        and getattr(type(model), name) is not getattr(torch.nn.Module, name)
    }
    assert redefined and redefined <= set(vars(SparseSpecForCausalLM)), redefined - set(vars(SparseSpecForCausalLM))
    try:
        assert wrapped.train() is wrapped and model.training and wrapped.training
    finally:
        assert wrapped.eval() is wrapped
    assert not model.training and not wrapped.training
    assert wrapped.to(model.device) is wrapped
    wrapped.tie_weights()
    assert wrapped.get_output_embeddings().weight is wrapped.get_input_embeddings().weight


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_gradient_checkpointing_and_tags(smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM) -> None:
    """What a trainer calls on its policy: gradient checkpointing on (by its old name too) and off, model tags."""
    model, _ = smollm2
    tags = model.model_tags
    try:
        wrapped.gradient_checkpointing_enable()
        assert model.is_activation_checkpointing and wrapped.is_activation_checkpointing
        wrapped.activation_checkpointing_disable()
        assert not model.is_activation_checkpointing
        wrapped.activation_checkpointing_enable()
        assert model.is_activation_checkpointing
        wrapped.add_model_tags(["torchspec-test"])
        assert "torchspec-test" in model.model_tags
    finally:
        model.activation_checkpointing_disable()
        model.model_tags = tags
    assert not wrapped.is_activation_checkpointing


def test_save_pretrained_writes_the_model(
    smollm2: tuple[Any, Any], wrapped: SparseSpecForCausalLM, tmp_path: Path
) -> None:
    """save_pretrained is the model's: a directory that loads back as the plain architecture, same weights."""
    model, _ = smollm2
    wrapped.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, local_files_only=True)
    assert type(loaded) is type(model) and loaded.config.architectures == ["LlamaForCausalLM"]
    expected = model.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in loaded.state_dict().items())


def test_pickle_and_deepcopy_keep_the_wrapper() -> None:
    """A copy (pickled, or deepcopied as trainers copy a reference model), also of a wrapper that has generated,
    is a wrapper of a copy of the model, sharing its module state with that copy, with an engine of its own
    (the KV pool is not copied), and generates the same tokens."""
    batch = Batch((5, 9))
    wrapped = sparsespec.wrap(tiny_spec("llama").build(), draft=None, kv_capacity_tokens=256)
    expected = wrapped.generate(**batch.kwargs(), max_new_tokens=4, do_sample=False)
    for copied in (pickle.loads(pickle.dumps(wrapped)), copy.deepcopy(wrapped)):
        assert type(copied) is SparseSpecForCausalLM and copied.hf_model is not wrapped.hf_model
        assert copied._modules is copied.hf_model._modules and copied._engine is None
        assert torch.equal(copied.generate(**batch.kwargs(), max_new_tokens=4, do_sample=False), expected)
