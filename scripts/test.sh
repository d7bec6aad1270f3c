#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (CPU is enough; GPU-only tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
py=${PYTHON:-python3}
"$py" -m ruff check .
exec "$py" -m pytest -q "$@"
