#!/usr/bin/env bash
# Installs everything modal-rl's tests and benchmarks need on a fresh Debian machine.
# Idempotent: a second run finds everything in place and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
  else
    echo "install.sh: bubblewrap (bwrap) is missing; install it with your package manager" >&2
  fi
fi

# The constraints file keeps torch on the local CPU build (an unpinned torch pulls CUDA).
python3 -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,bench]"
