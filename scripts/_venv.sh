# Sourced by the scripts in scripts/: the project's virtual environment and how we install
# into it. Nothing here touches the python that runs the scripts; see docs/install.md.
#
# Sets ROOT (the checkout), VENV (default: $ROOT/.venv, git-ignored; override with
# MODAL_RL_VENV), PY (the venv's python), and defines:
#   ensure_venv      make the venv if it is missing (python3 -m venv, else `uv venv`)
#   venv_install ... install into the venv with uv (default) or pip (MODAL_RL_INSTALLER=pip)
#   venv_uninstall . remove distributions from the venv
#   say ...          one line of ours, prefixed with the script's name
#   activate_venv    put the venv first on PATH, so subprocesses that run `python` get it
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MODAL_RL_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
INSTALLER=${MODAL_RL_INSTALLER:-uv}
UV_VERSION=0.13.9 # uv from PyPI, installed into the venv itself (measured: docs/install.md)
SCRIPT_NAME=$(basename "$0")

say() { echo "[$SCRIPT_NAME] $*"; }

# The installers' temp files (uv's uv-setuptools-*.lock, pip's build dirs) go to a directory
# of this script's own, made on first use and removed when the script exits, so an install
# leaves nothing in the temp directory. Only the installers get it: what the scripts run
# afterwards (the tests, the main job) uses the temp directory as given.
INSTALL_TMP=
installer_tmp() {
  if [ -z "$INSTALL_TMP" ]; then
    INSTALL_TMP=$(mktemp -d "${TMPDIR:-/tmp}/mrl-install-XXXXXXXX")
    trap 'rm -rf "$INSTALL_TMP"' EXIT
  fi
}

ensure_venv() {
  [ -x "$PY" ] && return 0
  local base=${PYTHON:-python3} t0=$SECONDS
  say "creating the project virtual environment $VENV (from $base)"
  # `-m venv` needs ensurepip, which Debian ships separately (python3-venv); without it the
  # venv module leaves a half-made directory behind, so test for it first.
  if "$base" -c 'import ensurepip, venv' 2>/dev/null; then
    "$base" -m venv "$VENV"
  elif command -v uv >/dev/null 2>&1; then
    uv venv -q --seed --python "$base" "$VENV"
  else
    echo "[$SCRIPT_NAME] cannot make $VENV: $base has no ensurepip; on Debian run 'apt-get install python3-venv' (or put uv on PATH)" >&2
    exit 1
  fi
  say "virtual environment ready in $((SECONDS - t0)) s"
}

_uv() {
  installer_tmp
  if [ ! -x "$VENV/bin/uv" ]; then
    TMPDIR=$INSTALL_TMP "$PY" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  fi
  # uv does not read pip's configuration; carry over the find-links / index settings a
  # machine gives pip through the environment (e.g. a local directory of CPU torch wheels).
  local env=("TMPDIR=$INSTALL_TMP")
  [ -n "${PIP_FIND_LINKS:-}" ] && [ -z "${UV_FIND_LINKS:-}" ] && env+=("UV_FIND_LINKS=$PIP_FIND_LINKS")
  [ -n "${PIP_INDEX_URL:-}" ] && [ -z "${UV_INDEX_URL:-}" ] && env+=("UV_INDEX_URL=$PIP_INDEX_URL")
  [ -n "${PIP_EXTRA_INDEX_URL:-}" ] && [ -z "${UV_EXTRA_INDEX_URL:-}" ] && env+=("UV_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
  env "${env[@]}" "$VENV/bin/uv" "$@"
}

venv_install() {
  if [ "$INSTALLER" = uv ]; then
    # --compile-bytecode: pip writes .pyc files at install and uv does not; without them every
    # process compiles what it imports, and under PYTHONDONTWRITEBYTECODE it does so each time
    # (measured: a launcher's start-up took 1.9 s of CPU instead of 0.6 s).
    _uv pip install -q --compile-bytecode --python "$PY" "$@"
  else
    installer_tmp
    TMPDIR=$INSTALL_TMP "$PY" -m pip install -q --disable-pip-version-check "$@"
  fi
}

venv_uninstall() {
  if [ "$INSTALLER" = uv ]; then
    _uv pip uninstall -q --python "$PY" "$@" 2>/dev/null || true
  else
    installer_tmp
    TMPDIR=$INSTALL_TMP "$PY" -m pip uninstall -q -y "$@" 2>/dev/null || true
  fi
}

activate_venv() {
  export VIRTUAL_ENV=$VENV
  export PATH="$VENV/bin:$PATH"
}
