#!/usr/bin/env bash
# W1 with a warm Triton kernel cache: a short speculative run compiles the kernel variants a draining batch
# needs (a fresh machine otherwise compiles them mid-run, ~15 s of an 80 s run, charged to whichever setting
# runs first), then W1 itself. Usage: bash benchmarks/w1_warm.sh MODEL.gguf OUT.jsonl [SETTING ...]
# (settings as bench.throughput's --drafts; default: none pillar_recent pillar_recent-delayed_verify).
set -euo pipefail
model=$1 out=$2
shift 2
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(none pillar_recent pillar_recent-delayed_verify)
python3 -m torchspec.bench.throughput --model "$model" --prompts 256 --max-new-tokens 2048 --temperature 0.65 \
    --drafts pillar_recent > /dev/null
# Long contexts (PillarAttn's Top-K past ~6K tokens takes another variant; W1 compiled it 35 s into its run).
python3 -m torchspec.bench.throughput --model "$model" --prompts 16 --max-new-tokens 8192 --temperature 0.65 \
    --drafts pillar_recent > /dev/null
python3 -m torchspec.bench.throughput --model "$model" --prompts 256 --max-new-tokens 8192 --temperature 0.65 \
    --drafts "${settings[@]}" --out "$out"
