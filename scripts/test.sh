#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (CPU is enough; GPU-only tests skip without CUDA), naming its
# 15 slowest tests (the suite aims at < 15 minutes on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
py=${PYTHON:-python3}
"$py" -m ruff check .
# One pytest worker per core (at most 4) without a GPU; with one, a single process: every worker would size its
# KV pool from the same free device memory.
workers=$("$py" -c "import os, torch; print(1 if torch.cuda.is_available() else min(4, os.cpu_count() or 1))")
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist worksteal)
exec "$py" -m pytest -q --durations=15 "${parallel[@]}" "$@"
