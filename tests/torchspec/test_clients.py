"""The evaluation and training clients users already run, end to end on CPU: lm-eval's ``simple_evaluate`` on local
JSONL tasks (one ``generate_until``, one ``loglikelihood``) with the wrapped SmolLM2 (fp32) against the plain model,
and a TRL ``GRPOTrainer`` step whose rollouts run on torchspec's engine. Skipped where the client is not installed
(CI installs both with the ``dev`` extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from torchspec import sparsespec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

QUESTIONS = [
    ("What is 2+2?", [" 4", " 5"]),
    ("Name a primary colour.", [" Red", " Green"]),
    ("What is the capital of France?", [" Paris", " Rome"]),
]
MAX_GEN_TOKS = 32


def _tasks(directory: Path) -> list[str]:
    """Two lm-eval tasks over one local JSONL file: a generation that stops at a newline or a full stop, and a
    multiple choice scored by log-likelihood."""
    data = directory / "questions.jsonl"
    rows = [{"question": f"Question: {q}\nAnswer:", "choices": c, "label": 0} for q, c in QUESTIONS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "{{question}}",
    }
    generate = {
        "task": "tiny_generate",
        "output_type": "generate_until",
        "doc_to_target": "{{choices[0]}}",
        "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    choose = {
        "task": "tiny_choice",
        "output_type": "multiple_choice",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    for task in (generate, choose):  # JSON is YAML
        (directory / f"{task['task']}.yaml").write_text(json.dumps(common | task))
    return [generate["task"], choose["task"]]


def test_lm_eval_simple_evaluate_matches_the_plain_model(smollm2: tuple[Any, Any], tmp_path: Path) -> None:
    """Batches of two: the same metrics and the same generated answers as the plain model, the generations come
    from torchspec's engine and stop at their ``until`` strings, not at ``max_gen_toks``."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = smollm2
    tasks = _tasks(tmp_path)
    wrapped = sparsespec.wrap(model, tokenizer=tokenizer, max_batch_size=2)
    runs = {}
    for name, target in (("plain", model), ("torchspec", wrapped)):
        runs[name] = simple_evaluate(
            model=HFLM(pretrained=target, tokenizer=tokenizer, batch_size=2),
            tasks=tasks,
            task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True,
        )
    plain, ours = runs["plain"], runs["torchspec"]
    for task in tasks:
        assert ours["results"][task] == plain["results"][task], task
    answers = [sample["resps"] for sample in ours["samples"]["tiny_generate"]]
    assert answers == [sample["resps"] for sample in plain["samples"]["tiny_generate"]]
    stats = wrapped.last_stats
    assert stats.num_requests > 0, "generate_until did not run on torchspec's engine"
    assert stats.generated_tokens < stats.num_requests * MAX_GEN_TOKS, "the rows should stop at `until`"


def test_trl_grpo_rollouts_run_on_the_engine_and_read_the_trained_weights(
    smollm2: tuple[Any, Any], tmp_path: Path
) -> None:
    """One GRPO step (``use_vllm=False``) on a tiny random Llama with SmolLM2's tokenizer, its ``generate``
    replaced by the wrapper's (weights shared by reference, no sync): the rollouts come from the engine, the step
    changes the weights (the fused q/k/v and gate/up ones too), and the next rollout reads them (greedy: the
    plain model's generate after the step). The engine is built by the trainer's first rollout, under its mixed
    precision's autocast (bf16 on a CPU), and computes in the model's dtype all the same (fused, fp32)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    _, tokenizer = smollm2
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    policy = LlamaForCausalLM(config)
    prompts = ["1, 2, 3,", "The sky is", "Hello", "2+2="]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    first = policy.generate(**batch, max_new_tokens=8, do_sample=False)  # the engine's first run is the trainer's
    wrapped = sparsespec.wrap(policy, tokenizer=tokenizer, max_batch_size=8)
    policy.generate = wrapped.generate
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=lambda completions, **kwargs: [float(len(text)) for text in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    trainer.train()
    stats = wrapped.last_stats  # the step's rollouts: 2 generations of 2 prompts
    assert wrapped.engine.fused_layers.count("decoder") == 2, "the layers should run fused under TRL's autocast"
    assert stats.num_requests == 4 and stats.generated_tokens > 0, "the rollouts did not run on the engine"
    changed = {name for name, p in policy.named_parameters() if not torch.equal(before[name], p)}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= changed, changed
    width = batch["input_ids"].shape[1]
    rollout = wrapped.generate(**batch, max_new_tokens=8, do_sample=False)
    assert not torch.equal(rollout, first), "the step should change the greedy rollout"
    # Greedy under the stepped weights: each new token is the plain model's top logit (within a numerical tie), the
    # model in its own dtype (fp32): without the bf16 autocast accelerate's mixed precision leaves on its forward.
    plain = trainer.accelerator.unwrap_model(policy, keep_fp32_wrapper=False)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(rollout[:, width:])], dim=1)
    with torch.no_grad():
        logits = plain(input_ids=rollout, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    logits = logits.logits[:, width - 1 : -1].float()
    for row, tokens in enumerate(rollout[:, width:].tolist()):
        length = tokens.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in tokens else len(tokens)
        chosen = logits[row, torch.arange(length), tokens[:length]]
        assert (logits[row, :length].max(-1).values - chosen).max() < 1e-4, (row, tokens)
