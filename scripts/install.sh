#!/usr/bin/env bash
# Installs modal-rl (editable) with what its tests and benchmarks need into the project's
# virtual environment (.venv/ at the repository root), never into the python that runs this.
# Idempotent: when nothing it installs from changed, it checks a stamp and exits at once.
# The facts behind each step: docs/install.md.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"

# The local sandbox provider's runtime: bubblewrap, and slirp4netns for network=True sandboxes
# (their own network namespace with outbound access, no route to the host: docs/sandboxes.md).
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v slirp4netns >/dev/null 2>&1 || missing+=(slirp4netns)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    say "installing ${missing[*]} (apt-get), the local sandbox provider's runtime"
    apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    say "${missing[*]} missing; install with your package manager (local sandboxes need them)" >&2
  fi
fi

# Headless Chromium: the report test opens the run report as a person would (docs/report.md).
# Checked by command, so a second run costs nothing; without root the test says why it skips.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    say "installing chromium (apt-get), the browser the run-report test renders the page in"
    t_chromium=$SECONDS
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; } ||
      say "chromium could not be installed; the browser test will skip and say so" >&2
    say "chromium step took $((SECONDS - t_chromium)) s"
  else
    say "chromium missing; install it (apt-get install chromium) to run the report's browser test" >&2
  fi
fi

ensure_venv
# What this install depends on: a change to any of these reinstalls.
stamp=$VENV/.modal-rl-install
want="$ROOT $(cat pyproject.toml setup.py constraints.txt scripts/cpu-pins.txt scripts/install.sh | sha256sum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  say "modal-rl [dev,bench] already installed in $VENV"
  exit 0
fi
t0=$SECONDS
say "installing modal-rl (editable) + dev and bench extras into $VENV with $INSTALLER ..."
# scripts/cpu-pins.txt keeps torch on the CPU build (an unpinned torch pulls CUDA).
venv_install -c constraints.txt -c scripts/cpu-pins.txt -e ".[dev,bench]"
echo "$want" >"$stamp"
say "modal-rl [dev,bench] installed in $((SECONDS - t0)) s"
