"""GPU time of a row-wise top-k over a vocabulary: ``torch.topk`` on the whole row against a top-k of chunks
first, then of the chunks' winners (the row's k largest are among its chunks' k largest).

    python benchmarks/topk_chunked.py --out benchmarks/results/topk_chunked_h200.jsonl

Shapes: a verify of 256 requests x 9 rows, a draft forward of 256 rows, SmolLM2's 49,152 vocabulary, k = 50
(transformers' default top_k), bf16 logits. Reports ms per call (CUDA events, median of repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from torchspec.sampling import chunked_topk


def _ms(run, repeats: int = 50) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    records = []
    for rows in (256, 2304):
        logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16)
        record = {"rows": rows, "vocab": args.vocab, "k": args.k, "device": torch.cuda.get_device_name()}
        record["torch_topk_ms"] = _ms(lambda logits=logits: logits.topk(args.k, dim=-1))
        for chunk in (256, 512, 1024, 2048, 4096):
            values, _ = chunked_topk(logits, args.k, chunk)
            assert torch.equal(values, logits.topk(args.k, dim=-1).values)
            record[f"chunked_{chunk}_ms"] = _ms(lambda logits=logits, chunk=chunk: chunked_topk(logits, args.k, chunk))
        print(json.dumps(record))
        records.append(record)
    if args.out:
        with open(args.out, "a") as file:
            file.writelines(json.dumps(record) + "\n" for record in records)


if __name__ == "__main__":
    main()
