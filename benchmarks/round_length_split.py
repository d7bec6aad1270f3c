"""Acceptance split by round length: does a loop accept fewer drafts per round, or choose shorter rounds?

    python benchmarks/round_length_split.py MODEL.gguf NEW_TOKENS TAG MODE [MODE ...] >> out.jsonl

MODE: ``ahead`` (the CUDA default: rounds launched ahead, adaptive round lengths), ``sync``
(``delayed_verify=False``), ``ahead_fixed`` (rounds ahead, every round k drafts). Runs W1's prompts (the 256
packaged reasoning prompts, T=0.65, EOS held back) with the default draft after a 16-token warm-up and prints
one JSON line per mode: tok/s, mean accepted and drafted per round, the drafted-length histogram, and the mean
accepted of full-length rounds (k drafts) by context bucket (thousands of tokens). Mean accepted alone mixes
what a draft achieves with how long the adaptive round lengths make rounds. Raw H200 output:
``results/round_length_split_h200.jsonl``.
"""

from __future__ import annotations

import collections
import gc
import json
import sys
import time

import torch

from torchspec import sparsespec
from torchspec.models import load_model
from torchspec.workloads import reasoning_prompt_ids

K = 8


def measure(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, mode: str) -> dict:
    gc.collect()  # the last mode's pool must be gone before this one sizes its own
    torch.cuda.empty_cache()
    options = {"delayed_verify": mode != "sync"} | ({"adaptive_rounds": False} if mode.endswith("_fixed") else {})
    wrapped = sparsespec.wrap(model, draft="pillar_recent", max_batch_size=len(prompts), **options)
    sampling = {"do_sample": True, "temperature": 0.65}
    wrapped.generate_batch(prompts, max_new_tokens=16, min_new_tokens=16, **sampling)  # graphs, kernels
    torch.manual_seed(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = wrapped.generate_batch(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sampling).values()
    seconds = time.perf_counter() - start
    accepted, drafted, contexts = [], [], []
    for output in outputs:
        stats = output.stats.speculation
        accepted += stats.accepted_per_round
        drafted += stats.drafts_per_round
        contexts += stats.context_per_round
    full = collections.defaultdict(list)  # context bucket (K tokens) -> accepted of full-length rounds
    for count, length, context in zip(accepted, drafted, contexts, strict=True):
        if length == K:
            full[min(context // 1024, 8)].append(count)
    full_rounds = [count for counts in full.values() for count in counts]
    graphs = wrapped.engine.runner.graphs
    return {
        "mode": mode,
        "tok_s": round(len(prompts) * new_tokens / seconds),
        "seconds": round(seconds, 1),
        "rounds": len(accepted),
        "mean_accepted": round(sum(accepted) / len(accepted), 3),
        "mean_drafted": round(sum(drafted) / len(drafted), 3),
        "full_rounds": len(full_rounds),
        "accepted_full": round(sum(full_rounds) / max(1, len(full_rounds)), 3),
        "drafted_hist": dict(sorted(collections.Counter(drafted).items())),
        "full_by_ctx_k": {bucket: round(sum(v) / len(v), 3) for bucket, v in sorted(full.items())},
        "captures": graphs.captures.count,
        "capture_s": round(graphs.captures.seconds, 1),
    }


def main() -> None:
    path, new_tokens, tag, *modes = sys.argv[1:]
    model, tokenizer = load_model(path, dtype=torch.bfloat16, device="cuda")
    prompts = [list(prompt) for prompt in reasoning_prompt_ids(tokenizer, 256)]
    for mode in modes:
        print(json.dumps({"tag": tag} | measure(model, prompts, int(new_tokens), mode)), flush=True)


if __name__ == "__main__":
    main()
