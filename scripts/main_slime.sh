#!/usr/bin/env bash
# The slime main job on the local default: slime's own train.py, unchanged, for 3 GRPO steps on
# this machine's CPU. SGLang generates on the CPU, Megatron trains on the CPU over gloo, and
# every step's new weights reach SGLang as our sparse delta through slime's disk-delta path and
# our hooks; a code task is scored in bubblewrap sandboxes by our reward. Installs slime's stack
# into .venv-slime/ first (scripts/install_slime_cpu.sh; quick when already there) and makes a
# tiny model, tokenizer and prompt set under runs/slime-cpu/tiny/. Extra arguments go to slime
# after ours (a later flag wins in slime's parser), e.g. --entry-free ones like --num-rollout 5.
#   MODAL_RL_SLIME_ENTRY=train_async.py   slime's async entry instead of train.py
#   MODAL_RL_SLIME_ENGINES=modal:1        the engine started, supervised and replaced by our
#                                         RolloutManager subclass (python -m slime_modal --rollout-engines)
#   SLIME_PATH / MEGATRON_PATH            checkouts to use instead of cloning (install script)
# See docs/quickstart-slime.md. Exit status: the run's, or 1 when the weight check fails.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export MODAL_RL_VENV=${MODAL_RL_SLIME_VENV:-$ROOT/.venv-slime}
source "$ROOT/scripts/_venv.sh"
cd "$ROOT"
# torch's compiled-kernel cache in the user's cache dir, never <temp>/torchinductor_<user> (as main.sh)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/modal-rl/torchinductor}
JOB_TMP=$(mktemp -d "${TMPDIR:-/tmp}/mrl-slime-XXXXXXXX")
trap 'rm -rf "$JOB_TMP"' EXIT
read -ra proc_stat <<<"$(sed 's/^.*) //' "/proc/$$/stat")"
echo "$$ ${proc_stat[19]}" >"$JOB_TMP/.mrl-owner" # field 22 of /proc/PID/stat: the start time

t0=$SECONDS
paths=$(TMPDIR=$JOB_TMP bash scripts/install_slime_cpu.sh | tee /dev/stderr | tail -n 2)
SLIME=$(sed -n 's/^SLIME_PATH=//p' <<<"$paths")
MEGATRON=$(sed -n 's/^MEGATRON_PATH=//p' <<<"$paths")
say "install took $((SECONDS - t0)) s"

ENTRY=${MODAL_RL_SLIME_ENTRY:-train.py}
RUN=${MODAL_RL_SLIME_RUN_DIR:-runs/slime-cpu/logs/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RUN"
RUN=$(cd "$RUN" && pwd)
t1=$SECONDS
LAUNCHER_ARGS=()
ARGS_FLAGS=()
if [ -n "${MODAL_RL_SLIME_ENGINES:-}" ]; then
  LAUNCHER_ARGS=(--rollout-engines "$MODAL_RL_SLIME_ENGINES")
  ARGS_FLAGS=(--external-engines)
fi
mapfile -t SLIME_ARGS < <(TMPDIR=$JOB_TMP "$PY" -m slime_modal.cpu.run_args runs/slime-cpu/tiny "$RUN" "${ARGS_FLAGS[@]}")
say "tiny model, tokenizer and prompts ready in $((SECONDS - t1)) s (runs/slime-cpu/tiny)"
say "running slime's $ENTRY (unchanged) through python -m slime_modal --backend local --cpu; full log: $RUN/slime.log"
t2=$SECONDS
set +e
"$PY" -m slime_modal --backend local --cpu "${LAUNCHER_ARGS[@]}" --entry "$ENTRY" --slime-path "$SLIME" --megatron-path "$MEGATRON" \
  --env "TENSORBOARD_DIR=$RUN/tensorboard" --env "MODAL_RL_RUN_PARTS_DIR=$RUN/parts" \
  -- "${SLIME_ARGS[@]}" "$@" 2>&1 | "$PY" -m slime_modal.cpu.console "$RUN/slime.log"
rc=${PIPESTATUS[0]}
set -e
say "slime $ENTRY run took $((SECONDS - t2)) s (exit $rc)"
[ "$rc" -eq 0 ] || exit "$rc"
"$PY" -m slime_modal.cpu.summary "$RUN" ${MODAL_RL_SLIME_CHECK_ARGS:-}
