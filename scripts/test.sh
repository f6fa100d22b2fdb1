#!/usr/bin/env bash
# The project's test command: install, lint, then the whole pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m pytest -q "$@"
