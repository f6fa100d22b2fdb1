#!/usr/bin/env bash
# The main job on the local default: install into .venv/ (quick when already there), then a
# real verl 0.9.1 GRPO run (3 steps) on this machine's CPU, with a tiny model made here.
# Extra arguments are Hydra overrides for verl. See docs/quickstart-verl.md, docs/install.md.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
t0=$SECONDS
bash scripts/install.sh
bash scripts/install_verl_cpu.sh
say "install took $((SECONDS - t0)) s"
activate_venv
t1=$SECONDS
python -m verl_modal --backend local --tiny runs/verl-cpu/tiny -- trainer.total_training_steps=3 "$@"
say "verl GRPO run (3 steps) took $((SECONDS - t1)) s"
