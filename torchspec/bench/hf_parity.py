"""Compare the engine's greedy output with transformers' own ``generate`` on reasoning prompts.

``python -m torchspec.bench.hf_parity --device cuda --dtype bfloat16 --prompts 16 --max-new-tokens 128``
prints and writes (``--out``) how many rows are identical, how many agree on their first 64 new tokens,
and the wall times, for each attention backend (``--backends``, default: the device's own and, on CUDA, the
reference too) against transformers and against the first backend. fp32 must be identical; bf16 rounds
differently in every kernel, so rows may drift.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from attention import BACKENDS
from torchspec import sparsespec
from torchspec.bench.records import add_model_arguments, append_record, environment
from torchspec.config import DRAFT_POLICIES
from torchspec.models import load_model
from torchspec.workloads import reasoning_prompt_ids


def _agreement(expected: torch.Tensor, actual: torch.Tensor, width: int, head: int) -> dict:
    """Rows identical (over the expected length) and rows equal on their first ``head`` new tokens."""
    return {
        "rows_identical": sum(
            bool(torch.equal(e, a)) for e, a in zip(expected, actual[:, : expected.shape[1]], strict=True)
        ),
        f"rows_first_{head}_equal": sum(
            bool(torch.equal(e[width : width + head], a[width : width + head]))
            for e, a in zip(expected, actual, strict=True)
        ),
    }


def compare(
    model_path: str | None,
    dtype: str,
    device: str,
    num_prompts: int,
    max_new_tokens: int,
    backends: tuple[str, ...] = ("auto",),
    draft: str | None = None,
) -> dict:
    hf_model, tokenizer = load_model(model_path, dtype=dtype, device=device)
    prompts = reasoning_prompt_ids(tokenizer, num_prompts)
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(device)
    timings = {}
    start = time.perf_counter()
    expected = hf_model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    timings["transformers_s"] = time.perf_counter() - start
    width = batch["input_ids"].shape[1]
    head = min(64, max_new_tokens)
    result = {
        **environment(device, dtype),
        "rows": len(prompts),
        "max_new_tokens": max_new_tokens,
        "draft": draft,
        **timings,
    }
    first = None
    for backend in backends:
        model = sparsespec.wrap(hf_model, tokenizer=tokenizer, draft=draft, attention_backend=backend)
        start = time.perf_counter()
        actual = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        result[backend] = {
            "seconds": time.perf_counter() - start,
            "identical": bool(torch.equal(expected, actual)),
            **_agreement(expected, actual, width, head),
            "stats": model.last_stats.summary(),
        }
        if first is None:
            first = (backend, actual)
        else:
            result[backend][f"vs_{first[0]}"] = _agreement(first[1], actual, width, head)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, dtype="float32")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft", default="none", choices=["none", *DRAFT_POLICIES], help="default: no speculation")
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), help="default: triton + reference on CUDA")
    parser.add_argument("--out", help="append the result as one JSON line to this file")
    args = parser.parse_args()
    backends = args.backends or (["triton", "reference"] if args.device.startswith("cuda") else ["reference"])
    draft = None if args.draft == "none" else args.draft
    result = compare(args.model, args.dtype, args.device, args.prompts, args.max_new_tokens, tuple(backends), draft)
    print(json.dumps(result))
    append_record(args.out, result)


if __name__ == "__main__":
    main()
