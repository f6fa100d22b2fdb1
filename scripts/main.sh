#!/usr/bin/env bash
# The main job on the local default: install into .venv/ (quick when already there), then a
# real verl 0.9.1 GRPO run (3 steps) on this machine's CPU, with a tiny model made here.
# Extra arguments are Hydra overrides for verl. See docs/quickstart-verl.md, docs/install.md.
#
# The job adds nothing to the temp directory. torch's compiled-kernel cache goes to the user's
# cache dir (as modal_rl.run_temp.kernel_cache_dir), never to <temp>/torchinductor_<user>; the
# install steps (whose import checks load vLLM) get a temp folder of the job's own,
# <temp>/mrl-main-*, removed when the job exits; the verl run keeps its own run folders
# (modal_rl.run_temp). The job's folder carries an owner mark (.mrl-owner: this shell's PID and
# start time), so if the job is SIGKILLed the next run's start sweeps it.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/modal-rl/torchinductor}
JOB_TMP=$(mktemp -d "${TMPDIR:-/tmp}/mrl-main-XXXXXXXX")
trap 'rm -rf "$JOB_TMP"' EXIT
read -ra proc_stat <<<"$(sed 's/^.*) //' "/proc/$$/stat")"
echo "$$ ${proc_stat[19]}" >"$JOB_TMP/.mrl-owner" # field 22 of /proc/PID/stat: the start time
t0=$SECONDS
TMPDIR=$JOB_TMP bash scripts/install.sh
TMPDIR=$JOB_TMP bash scripts/install_verl_cpu.sh
say "install took $((SECONDS - t0)) s"
activate_venv
t1=$SECONDS
# tensorboard beside the console: verl's own tracker then holds our modal_rl/ numbers too.
python -m verl_modal --backend local --tiny runs/verl-cpu/tiny -- trainer.total_training_steps=3 \
  'trainer.logger=[console,tensorboard]' "$@"
say "verl GRPO run (3 steps) took $((SECONDS - t1)) s"
# The run's folder is the newest under the launcher's log dir (it names it in its summary too).
run_dir=$(ls -1dt runs/verl-cpu/logs/*/ | head -n 1)
run_dir=${run_dir%/}
if [ -f "$run_dir/report.html" ]; then
  say "run report: $ROOT/$run_dir/report.html (static, opens offline in any browser)"
fi
if [ -d "$run_dir/tensorboard" ]; then
  say "tensorboard: $ROOT/$run_dir/tensorboard (tensorboard --logdir $run_dir/tensorboard)"
fi
