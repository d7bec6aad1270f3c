#!/usr/bin/env bash
# The measurements a GPU session owes, one part per call (a device call runs at most 10 minutes; each part fits
# one): bash benchmarks/gpu_session.sh MODEL.gguf OUT_DIR PART, PART one of
#   tests       the GPU tests (kernels, sampling, graphs, benchmarks, Triton backend, offload), ~80 s
#   w1          W1 warm: none and pillar_recent (docs/performance.md), ~300 s
#   w3          W3, EOS held back (1,024 requests x 8,192 tokens), for each SETTING given after PART (default:
#               pillar_recent, then pillar_recent+offload; a W3 setting takes 2.5-3 minutes on an H200), each
#               after a 20-second untimed run of every setting
#   w3-natural  W3 with EOS respected (~45 s a setting on an H100, ~3.5 minutes the part)
#   profile     GPU busy time per step in steady state and the kernels filling it (benchmarks/gpu_busy_profile.py):
#               W1's pillar_recent rounds at steps 300, 700 and 1,000, its plain steps at 1,000, 4,000 and 7,000, ~4 min
#   paced       issue 14: W1's plain decoding alone (its trace keeps the host's time in each step phase), its GPU busy
#               time at steps 1,000, 4,000 and 7,000, how much of its wall time is above the GPU's work
#               (benchmarks/host_paced.py), its steps by ranges of 100 with the host's CPU time and the garbage
#               collector's pauses (benchmarks/step_phases.py: where the host as a whole ran slower), and a steady
#               stretch's host time by function (benchmarks/host_split.py), ~6 min on an H200
#   drain       issue 14: where a draining W1 round's GPU time goes (pillar_recent at steps 1,150, 1,200 and 1,235:
#               18, 6 and 2 running requests on session 46's H100), ~2.5 min; the w1 part's record names the list
#               lengths each graph was captured for (graph_capture_events)
#   against     W1 of one setting on another tree, then on this one, back to back on one machine (run-to-run noise on
#               one machine is ~3%, between machines more): PART DIR [SETTING], DIR holding the other tree's attention/
#               and torchspec/ (git archive REF attention torchspec | tar x -C DIR), SETTING by default pillar_recent,
#               each after w1_warm.sh's warm-ups, ~6 min on an H100. The other tree runs from inside DIR: python -m
#               imports from the current directory before PYTHONPATH (session 47's first two such runs ran this tree)
#   sketch      issue 19: query_sketch against pillar_recent at 2,048 new tokens, where a query_sketch step's GPU time
#               goes and its host's, and one layer's choice at W1's shapes (benchmarks/sketch_choice_micro.py), ~4 min
# Records land in OUT_DIR as JSON lines (written as each setting ends, so a part cut at its limit keeps the
# settings it finished). Session 30's first W3-natural pair on a fresh H100, before the untimed runs, spent 23 s of
# its offload run capturing graphs (3.5 s of it Triton compiles; the rest not explained) and measured 1.14x, the same
# pair run again there 1.27x.
set -uo pipefail
model=$1 out=$2 part=$3
shift 3
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(pillar_recent pillar_recent+offload)
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the sketch part runs a script from benchmarks/
w3() {  # w3 RECORDS.jsonl [ARGS...]; one process per setting: a W3 run leaves ~36 GB on the device that the next one's automatic pool would miss
    # Each setting first runs the same workload untimed for 20 s: it compiles the kernel variants its admission pattern
    # needs (session 40: W3-natural without offload, after warm-ups at 1,024 new tokens, still compiled 6 s of
    # variants mid-run and measured 23,743 tok/s, 28,569 on its next run).
    local records=$1
    shift
    for pass in warm timed; do
        for setting in "${settings[@]}"; do
            local run=(--time-limit 20) to=/dev/null
            [ $pass = timed ] && run=(--out "$records") to=/dev/stdout
            python3 -m torchspec.bench.throughput --model "$model" --prompts 1024 --max-new-tokens 8192 \
                --temperature 0.65 --drafts "$setting" "${run[@]}" "$@" > $to
        done
    done
}
plain_profile() {  # W1's plain steps at 1,000, 4,000 and 7,000: the GPU's busy time as their contexts grow
    python3 benchmarks/gpu_busy_profile.py "$model" 8192 none 1000,4000,7000 8
}
case $part in
tests)
    python3 -m pytest -q tests/attention/test_paged_attention.py tests/attention/test_select_kernels.py tests/attention/test_logits_kernels.py \
        tests/torchspec/test_sampling.py tests/torchspec/test_cuda_graphs.py tests/torchspec/test_bench_throughput.py \
        tests/torchspec/test_triton_backend.py tests/torchspec/test_offload.py \
        -k "cuda or gpu or sync or warped or target or kernel or reference or offload" 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
    ;;
w1) bash benchmarks/w1_warm.sh "$model" "$out/w1.jsonl" none pillar_recent ;;
w3) w3 "$out/w3.jsonl" ;;
w3-natural) w3 "$out/w3_natural.jsonl" --natural-lengths ;;
profile)
    python3 benchmarks/gpu_busy_profile.py "$model" 8192 pillar_recent 300,700,1000 8 > "$out/gpu_busy_profile.txt"
    plain_profile >> "$out/gpu_busy_profile.txt"
    ;;
paced)
    python3 -m torchspec.bench.throughput --model "$model" --prompts 256 --max-new-tokens 8192 --temperature 0.65 \
        --drafts none --out "$out/w1_none.jsonl"
    plain_profile > "$out/gpu_busy_profile_none.txt"
    python3 -m benchmarks.host_paced "$out/w1_none.jsonl" none "$out/gpu_busy_profile_none.txt" > "$out/host_paced_none.txt"
    python3 benchmarks/step_phases.py "$model" 8192 none "$out/step_phases_none.json" > "$out/step_phases_none.txt"
    python3 -m benchmarks.host_split "$model" 1800 none 300 1000 20 > "$out/host_split_none.txt"
    ;;
drain) python3 benchmarks/gpu_busy_profile.py "$model" 8192 pillar_recent 1150,1200,1235 4 > "$out/gpu_busy_profile_drain.txt" ;;
sketch)
    python3 -m torchspec.bench.throughput --model "$model" --prompts 256 --max-new-tokens 2048 --temperature 0.65 \
        --drafts pillar_recent query_sketch --out "$out/query_sketch_2048.jsonl"
    python3 benchmarks/gpu_busy_profile.py "$model" 2048 query_sketch 60,150 4 > "$out/gpu_busy_profile_query_sketch.txt"
    python3 -m benchmarks.host_cprofile "$model" 2048 query_sketch 60 6 > "$out/host_cprofile_query_sketch.txt"
    (cd benchmarks && python3 sketch_choice_micro.py > "$out/sketch_choice_micro.jsonl")
    ;;
against)
    [ -d "${settings[0]}" ] || { echo "against: give the other tree's directory after the part" >&2; exit 2; }
    other=$(cd "${settings[0]}" && pwd) here=$PWD setting=${settings[1]:-pillar_recent}
    (cd "$other" && PYTHONPATH="$other:${PYTHONPATH:-}" bash "$here/benchmarks/w1_warm.sh" "$model" "$out/w1_other.jsonl" \
        "$setting")
    bash benchmarks/w1_warm.sh "$model" "$out/w1.jsonl" "$setting"
    ;;
*) echo "unknown part $part: tests, w1, w3, w3-natural, profile, paced, drain, against or sketch" >&2; exit 2 ;;
esac
