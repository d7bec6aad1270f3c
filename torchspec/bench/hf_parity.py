"""Compare the engine's greedy output with transformers' own ``generate`` on reasoning prompts.

``python -m torchspec.bench.hf_parity --device cuda --dtype bfloat16 --prompts 16 --max-new-tokens 128``
prints and writes (``--out``) how many rows are identical, how many agree on their first 64 new tokens,
and both wall times. fp32 must be identical; bf16 rounds differently in every kernel, so rows may drift.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from torchspec import sparsespec
from torchspec.models import load_model
from torchspec.workloads import chat_token_ids, read_prompts


def compare(model_path: str | None, dtype: str, device: str, num_prompts: int, max_new_tokens: int) -> dict:
    hf_model, tokenizer = load_model(model_path, dtype=dtype, device=device)
    prompts = [chat_token_ids(tokenizer, text) for text in read_prompts(limit=num_prompts)]
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(device)
    timings = {}
    start = time.perf_counter()
    expected = hf_model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    timings["transformers_s"] = time.perf_counter() - start
    model = sparsespec.wrap(hf_model, tokenizer=tokenizer)
    start = time.perf_counter()
    actual = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    timings["torchspec_s"] = time.perf_counter() - start
    width = batch["input_ids"].shape[1]
    head = min(64, max_new_tokens)
    return {
        "dtype": dtype,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "rows": len(prompts),
        "max_new_tokens": max_new_tokens,
        "identical": bool(torch.equal(expected, actual)),
        "rows_identical": sum(
            bool(torch.equal(e, a)) for e, a in zip(expected, actual[:, : expected.shape[1]], strict=True)
        ),
        f"rows_first_{head}_equal": sum(
            bool(torch.equal(e[width : width + head], a[width : width + head]))
            for e, a in zip(expected, actual, strict=True)
        ),
        **timings,
        "torchspec_stats": model.last_stats.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="append the result as one JSON line to this file")
    args = parser.parse_args()
    result = compare(args.model, args.dtype, args.device, args.prompts, args.max_new_tokens)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as sink:
            sink.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
