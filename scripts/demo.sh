#!/usr/bin/env bash
# Set up, then answer reasoning prompts with the embedded SmolLM2-135M-Instruct (extra args go to the CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m torchspec generate --reasoning-prompts --limit 4 --max-new-tokens 128 "$@"
