"""Benchmark and demo workloads: the packaged reasoning prompts, in the model's chat template."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

REASONING_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def read_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Prompts from a ``.jsonl`` file (field ``prompt``) or a text file (one a line); None = the packaged
    AIME 2024 + OlympiadBench problems, each followed by the reasoning instruction. A ``limit`` past the file's
    length cycles it (W3's 1,024 requests: the 705 packaged prompts, then the first 319 again)."""
    if path is None:
        text = resources.files("torchspec").joinpath("data/reasoning_prompts.jsonl").read_text()
        prompts = [f"{json.loads(line)['prompt']}\n{REASONING_INSTRUCTION}" for line in text.splitlines() if line]
    else:
        path = Path(path)
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        prompts = [json.loads(line)["prompt"] for line in lines] if path.suffix == ".jsonl" else lines
    if limit is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(limit)]


def chat_token_ids(tokenizer: Any, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn in the tokenizer's chat template, ready for the assistant's answer."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def prompt_ids(tokenizer: Any, path: str | Path | None = None, limit: int | None = None) -> list[list[int]]:
    """The prompts of ``path`` (None: the packaged reasoning prompts), cycled to ``limit``, as token ids in the
    tokenizer's chat template."""
    return [chat_token_ids(tokenizer, text) for text in read_prompts(path, limit)]


def reasoning_prompt_ids(tokenizer: Any, limit: int | None = None) -> list[list[int]]:
    """The first ``limit`` packaged reasoning prompts as token ids in the tokenizer's chat template: W1's
    prompts, which every benchmark decodes."""
    return prompt_ids(tokenizer, None, limit)
