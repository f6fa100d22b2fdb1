#!/usr/bin/env bash
# GPU check of the weight-sync CUDA path on one H200 (< 8 minutes): times diff, gather,
# encode, decode and apply on an 8.6 GB bf16 state against the device's copy bandwidth.
#
# Run it through the device tool from the repository root. The device image has torch,
# numpy and xxhash but not zstandard: carry a wheel built for its Python (3.12), made here
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       zstandard -d benchmarks/.wheels
# and pass `carry: ["benchmarks/.wheels"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import zstandard" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links benchmarks/.wheels zstandard
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH=. timeout 450 python3 -m benchmarks.gpu_weight_sync --gb "${GB:-8.6}" --density "${DENSITY:-0.01}" "$@"
