#!/usr/bin/env bash
# The main job on the local default: install, then run it. See README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m benchmarks weight-sync --quick --out runs/weight-sync "$@"
