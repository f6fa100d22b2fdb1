#!/usr/bin/env bash
# Installs slime's CPU stack into its own virtual environment, .venv-slime/ (git-ignored;
# override with MODAL_RL_SLIME_VENV): slime asserts numpy 1.x while verl's stack (.venv/) needs
# numpy 2, so the two never share one. The pin set is scripts/slime-cpu-lock.txt (SGLang
# 0.5.15.post1 with CPU torch 2.13.0, installed with --no-deps: SGLang's wheel asks for CUDA
# builds), then modal-rl itself (editable, no deps: the lock holds them).
#
# Then gets slime and Megatron-LM at slime's pinned commits into runs/slime-src/ (override with
# MODAL_RL_SLIME_SRC), cloned from their public repositories (MODAL_RL_SLIME_REPO /
# MODAL_RL_MEGATRON_REPO name other clones), or uses the checkouts SLIME_PATH / MEGATRON_PATH as
# they are. A clone gets our series (patches/slime) on slime and slime's own docker/patch Megatron
# patches on Megatron-LM. The installed SGLang gets slime's SGLang patches for its version (their
# /pull_weights route is what the disk-delta sync calls) plus our decoders (patches/sglang).
# Prints SLIME_PATH=... and MEGATRON_PATH=... as its last two lines.
# Idempotent: what is in place is checked and kept.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export MODAL_RL_VENV=${MODAL_RL_SLIME_VENV:-$ROOT/.venv-slime}
source "$ROOT/scripts/_venv.sh"
cd "$ROOT"

SLIME_REPO=${MODAL_RL_SLIME_REPO:-https://github.com/THUDM/slime}
SLIME_COMMIT=624b824a8
MEGATRON_REPO=${MODAL_RL_MEGATRON_REPO:-https://github.com/NVIDIA/Megatron-LM}
MEGATRON_COMMIT=1dcf0dafa
SGLANG_VERSION=0.5.15.post1
LOCK=scripts/slime-cpu-lock.txt
SRC=${MODAL_RL_SLIME_SRC:-$ROOT/runs/slime-src}

t0=$SECONDS
ensure_venv
lock_sum=$(sha256sum "$LOCK" | cut -c1-16)
if [ "$(cat "$VENV/.modal-rl-lock" 2>/dev/null)" != "$lock_sum" ]; then
  say "installing slime's CPU stack ($LOCK) into $VENV with $INSTALLER ..."
  venv_install --no-deps -r "$LOCK"
  venv_install --no-deps -e .
  echo "$lock_sum" >"$VENV/.modal-rl-lock"
  say "  installed in $((SECONDS - t0)) s"
fi
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# A checkout at a commit: the given one, else a clone of the public repository.
checkout() { # name repo commit given-path
  local name=$1 repo=$2 commit=$3 given=$4 dir=$SRC/$1
  if [ -n "$given" ]; then
    echo "$given"
    return
  fi
  if [ ! -d "$dir/.git" ]; then
    mkdir -p "$SRC"
    git clone -q "$repo" "$dir" >&2
  fi
  if [ "$(git -C "$dir" rev-parse HEAD 2>/dev/null)" != "$(git -C "$dir" rev-parse "$commit^{commit}" 2>/dev/null)" ] ||
    [ ! -f "$dir/.modal-rl-patched" ]; then
    git -C "$dir" checkout -q -f "$commit" >&2
    git -C "$dir" clean -qfdx >&2
  fi
  echo "$dir"
}

gitq() { git -c user.name=modal-rl -c user.email=modal-rl@localhost "$@"; }

SLIME=$(checkout slime "$SLIME_REPO" "$SLIME_COMMIT" "${SLIME_PATH:-}")
MEGATRON=$(checkout Megatron-LM "$MEGATRON_REPO" "$MEGATRON_COMMIT" "${MEGATRON_PATH:-}")
if [ -z "${SLIME_PATH:-}" ] && [ ! -f "$SLIME/.modal-rl-patched" ]; then
  for patch in patches/slime/0*.patch; do
    gitq -C "$SLIME" am -q -3 "$ROOT/$patch" >&2
  done
  touch "$SLIME/.modal-rl-patched"
  say "slime $SLIME_COMMIT + patches/slime at $SLIME"
fi
if [ -z "${MEGATRON_PATH:-}" ] && [ ! -f "$MEGATRON/.modal-rl-patched" ]; then
  # slime's image applies these two, in this order (its docker/Dockerfile).
  for patch in megatron.patch megatron-sglang-aligned.patch; do
    git -C "$MEGATRON" apply "$SLIME/docker/patch/latest/$patch"
  done
  touch "$MEGATRON/.modal-rl-patched"
  say "Megatron-LM $MEGATRON_COMMIT + slime's Megatron patches at $MEGATRON"
fi

# SGLang: slime's patches for this version, in its image's order; pull_weights needs the
# others as its context. The mark holds the slime commit the patches came from.
mark="$SITE/sglang/.modal-rl-patched"
if [ "$(cat "$mark" 2>/dev/null)" != "$(git -C "$SLIME" rev-parse HEAD)" ]; then
  # from the wheel's own files (a copy patched before, from another slime, is replaced)
  venv_install --no-deps --reinstall-package sglang "sglang==$SGLANG_VERSION"
  patches=(sglang.patch sglang-top_p.patch sglang-release_hicache.patch sglang-pull_weights.patch)
  for patch in "${patches[@]}"; do
    # files a patch adds are not the wheel's: a reinstall leaves an earlier copy behind
    awk '/^--- \/dev\/null/ {n=1; next} n && /^\+\+\+ b\/python\// {print substr($2, 10)} {n=0}' \
      "$SLIME/docker/patch/v$SGLANG_VERSION/$patch" | while read -r added; do rm -f "$SITE/$added"; done
    patch -p2 -s -d "$SITE" <"$SLIME/docker/patch/v$SGLANG_VERSION/$patch"
  done
  "$PY" - "$SITE" <<'PYEOF'
import pathlib, sys
from slime_modal.upstream import DECODERS, SGLANG_SERIES_DIR, extract_new_file
site = pathlib.Path(sys.argv[1])
for patch in sorted(SGLANG_SERIES_DIR.glob("0*.patch")):
    text = patch.read_text()
    if f"+++ b/{DECODERS}" in text:
        (site / DECODERS.removeprefix("python/")).write_text(extract_new_file(text, DECODERS))
PYEOF
  git -C "$SLIME" rev-parse HEAD >"$mark"
  say "SGLang $SGLANG_VERSION + slime's SGLang patches + patches/sglang in $SITE"
fi
say "slime CPU stack ready in $((SECONDS - t0)) s"
echo "SLIME_PATH=$SLIME"
echo "MEGATRON_PATH=$MEGATRON"
