#!/usr/bin/env bash
# GPU check of the weight-sync CUDA path on one H200 (< 8 minutes): times diff, gather,
# encode, decode and apply on an 8.6 GB bf16 state against the device's copy bandwidth.
#
# Run it through the device tool from the repository root. The device image has torch,
# numpy and xxhash but not zstandard, nor numba (chunk coding v2's kernels): carry wheels built
# for its Python (3.12), made here
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       zstandard numba -d benchmarks/.wheels
# (numba pulls llvmlite: ~45 MB in all) and pass `carry: ["benchmarks/.wheels"]`.
# Encode and decode run for chunk coding v1 and v2 side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
for module in zstandard numba; do
  if ! python3 -c "import $module" 2>/dev/null; then
    python3 -m pip install -q --no-index --find-links benchmarks/.wheels "$module"
  fi
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH=. timeout 450 python3 -m benchmarks.gpu_weight_sync --gb "${GB:-8.6}" --density "${DENSITY:-0.01}" "$@"
