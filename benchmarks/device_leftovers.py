"""What a finished run leaves on the device (CUDA): W3 runs left ~36 GB cached that ``empty_cache`` could not free and
~1 GB allocated, so the next engine in the process sized a smaller automatic pool (docs/performance.md, KV offload).

    python -m benchmarks.device_leftovers MODEL.gguf [PROMPTS] [NEW_TOKENS] [SETTING]

Runs one ``measure`` (default: 1,024 prompts x 64 tokens of ``pillar_recent``, enough for W3's batch buckets) with
the allocator recording every allocation's stack, drops the run, collects and empties the cache, then prints the
memory still held and the segments still reserved, largest first, each with the stack that allocated its largest
live block (or "free" for a segment whose blocks are all free yet kept: a CUDA graph pool not released).
"""

import gc
import sys

import torch

from torchspec.bench.records import parse_setting
from torchspec.bench.throughput import device_memory_gib, measure
from torchspec.models import load_model
from torchspec.workloads import reasoning_prompt_ids

SEGMENTS_SHOWN = 12


def main() -> None:
    path = sys.argv[1]
    prompts, new_tokens = (int(sys.argv[i]) if len(sys.argv) > i else default for i, default in ((2, 1024), (3, 64)))
    draft, options = parse_setting(sys.argv[4] if len(sys.argv) > 4 else "pillar_recent")
    model, tokenizer = load_model(path, dtype=torch.bfloat16, device="cuda")
    ids = reasoning_prompt_ids(tokenizer, prompts)
    print("before:", device_memory_gib(torch.device("cuda")))
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    record = measure(model, ids, draft, new_tokens, 0.65, **options)
    print(f"run: {record['tokens_per_s']:,.0f} tok/s, pool {record['kv_capacity_tokens']:,} tokens")
    del record
    gc.collect()
    print("after:", device_memory_gib(torch.device("cuda")))
    segments = torch.cuda.memory._snapshot()["segments"]
    for segment in sorted(segments, key=lambda s: -s["total_size"])[:SEGMENTS_SHOWN]:
        live = [block for block in segment["blocks"] if block["state"] == "active_allocated"]
        print(
            f"\nsegment {segment['total_size'] / 2**20:,.0f} MiB, pool {segment.get('segment_pool_id')}, "
            f"{sum(b['size'] for b in live) / 2**20:,.0f} MiB live in {len(live)} blocks"
        )
        if live:
            frames = max(live, key=lambda b: b["size"]).get("frames", [])
            for frame in [f for f in frames if "torchspec" in f["filename"] or "attention" in f["filename"]][:6]:
                print(f"    {frame['filename']}:{frame['line']} {frame['name']}")
        else:
            print("    free")


if __name__ == "__main__":
    main()
