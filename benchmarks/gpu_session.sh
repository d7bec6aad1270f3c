#!/usr/bin/env bash
# The measurements a GPU session owes, one part per call (a device call runs at most 10 minutes; each part fits
# one): bash benchmarks/gpu_session.sh MODEL.gguf OUT_DIR PART, PART one of
#   tests       the GPU tests (kernels, sampling, graphs, benchmarks, Triton backend, offload), ~80 s
#   w1          W1 warm: none and pillar_recent (docs/performance.md), ~300 s
#   w3          W3, EOS held back (1,024 requests x 8,192 tokens), for each SETTING given after PART (default:
#               pillar_recent, then pillar_recent+offload; a W3 setting takes 2.5-3 minutes on an H200)
#   w3-natural  W3 with EOS respected
# Records land in OUT_DIR as JSON lines (written as each setting ends, so a part cut at its limit keeps the
# settings it finished). On a fresh machine run w1 (or any part) first and compare W3 pairs on a machine that already
# ran one: session 30's first W3-natural pair on a fresh H100 spent 23 s of its offload run capturing graphs (3.5 s
# of it Triton compiles; the rest not explained) and measured 1.14x, the same pair run again there 1.27x.
set -uo pipefail
model=$1 out=$2 part=$3
shift 3
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(pillar_recent pillar_recent+offload)
mkdir -p "$out"
w3() {  # one process per setting: a W3 run leaves ~36 GB on the device that the next one's automatic pool would miss
    for setting in "${settings[@]}"; do
        python3 -m torchspec.bench.throughput --model "$model" --prompts 1024 --max-new-tokens 8192 --temperature 0.65 \
            --drafts "$setting" "$@"
    done
}
case $part in
tests)
    python3 -m pytest -q tests/attention/test_paged_attention.py tests/attention/test_select_kernels.py tests/attention/test_logits_kernels.py \
        tests/torchspec/test_sampling.py tests/torchspec/test_cuda_graphs.py tests/torchspec/test_bench_throughput.py \
        tests/torchspec/test_triton_backend.py tests/torchspec/test_offload.py \
        -k "cuda or gpu or sync or warped or target or kernel or reference or offload" 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
    ;;
w1) bash benchmarks/w1_warm.sh "$model" "$out/w1.jsonl" none pillar_recent ;;
w3) w3 --out "$out/w3.jsonl" ;;
w3-natural) w3 --natural-lengths --out "$out/w3_natural.jsonl" ;;
*) echo "unknown part $part: tests, w1, w3 or w3-natural" >&2; exit 2 ;;
esac
