#!/usr/bin/env bash
# The main job on the local default: install, then a real verl 0.9.1 GRPO run (3 steps) on
# this machine's CPU, with a tiny model made here. Extra arguments are Hydra overrides for verl.
# See docs/quickstart-verl.md.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/install.sh
bash scripts/install_verl_cpu.sh
echo "main.sh: install took $((SECONDS - t0)) s"
t1=$SECONDS
python3 -m verl_modal --backend local --tiny runs/verl-cpu/tiny -- trainer.total_training_steps=3 "$@"
echo "main.sh: verl GRPO run (3 steps) took $((SECONDS - t1)) s"
