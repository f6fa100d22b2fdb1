"""The built wheel works outside the repository, with the `modal` extra only.

Builds the sdist and, from it, the wheel (``python -m build``: the wheel a package index
would serve), installs ``<wheel>[modal]`` into a fresh virtual environment (uv, from its
cache when it can), and runs the documented commands there from a directory that is not the
checkout: ``--version``, a slime Modal dry run (its patch series come from the wheel), the verl
launcher without verl (one line naming the extra, exit 2), ``status --dry-run``, and the
weight-sync CLI on small files (``inspect`` without torch or key; ``encode`` names torch).
The environment holds at most 40 distributions and no CUDA library.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_DISTRIBUTIONS = 40
CUDA = re.compile(r"^(nvidia-|cuda-|triton$|cupy)", re.I)

pytestmark = pytest.mark.slow


def _uv() -> str:
    uv = Path(sys.executable).with_name("uv")
    if uv.is_file():
        return str(uv)
    found = shutil.which("uv")
    if found is None:
        pytest.skip("uv is not installed (scripts/install.sh puts it into the venv)")
    return found


def _run(argv, cwd, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(map(str, argv)), cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw
    )


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    work = tmp_path_factory.mktemp("wheel")
    built = _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", work / "dist", ROOT],
        cwd=work,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (work / "dist").glob("*.whl")
    uv = _uv()
    venv = work / "venv"
    made = _run([uv, "venv", "-q", "--python", sys.executable, venv], cwd=work)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    install = [
        uv,
        "pip",
        "install",
        "-q",
        "--python",
        python,
        "-c",
        ROOT / "constraints.txt",
        f"{wheel}[modal]",
    ]
    done = _run([*install, "--offline"], cwd=work)
    if done.returncode != 0:  # not all in uv's cache: the index the machine is configured with
        done = _run(install, cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    return venv, elsewhere, wheel


def _in_venv(venv: Path, cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return _run([venv / "bin" / "modal-rl", *args], cwd=cwd, timeout=120, env={**clean, **(env or {})})


def test_wheel_installs_few_packages_and_no_cuda(wheel_env):
    venv, elsewhere, _ = wheel_env
    listed = _run(
        [
            venv / "bin" / "python",
            "-c",
            "import importlib.metadata as m; print('\\n'.join(sorted({d.metadata['Name'] for d in m.distributions()})))",
        ],
        cwd=elsewhere,
    )
    names = listed.stdout.split()
    assert "modal-rl" in names and "modal" in names, names
    assert len(names) <= MAX_DISTRIBUTIONS, f"{len(names)} distributions: {names}"
    assert not [n for n in names if CUDA.match(n)] and "torch" not in names, names


def test_version_and_help_from_another_directory(wheel_env):
    venv, elsewhere, _ = wheel_env
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    r = _in_venv(venv, elsewhere, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"modal-rl {version}", r.stderr
    r = _in_venv(venv, elsewhere, "--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("verl", "slime", "weightsync", "status"))


def test_slime_modal_dry_run_uses_the_packaged_series(wheel_env):
    venv, elsewhere, _ = wheel_env
    r = _in_venv(
        venv,
        elsewhere,
        *("slime", "--backend", "modal", "--gpu", "H100:8", "--name", "my-run", "--dry-run", "--json", "--"),
        *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate"),
        *("--rollout-num-gpus-per-engine", "2"),
    )
    assert r.returncode == 0, r.stderr
    assert '"app": "my-run"' in r.stdout
    packaged = "site-packages/modal_rl/patch_series/slime -> /opt/modal_rl/patches/slime"
    assert packaged in r.stdout and f"{ROOT}/" not in r.stdout


def test_verl_without_its_extra_is_one_install_line(wheel_env):
    venv, elsewhere, _ = wheel_env
    r = _in_venv(venv, elsewhere, "verl", "--backend", "modal", "--gpu", "H100:8", "--dry-run", "--", "a=1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "pip install 'modal-rl[verl]'" in r.stderr


def test_run_commands_and_bench_outside_a_checkout(wheel_env):
    venv, elsewhere, _ = wheel_env
    r = _in_venv(venv, elsewhere, "logs", "my-run", "--dry-run")
    assert r.returncode == 0 and "app list --json" in r.stdout and "app logs --follow <app id>" in r.stdout
    r = _in_venv(venv, elsewhere, "bench", "list")
    assert r.returncode == 2 and "checkout" in r.stderr


def test_weightsync_cli_on_small_files(wheel_env, tmp_path):
    import torch
    from safetensors.torch import save_file

    venv, elsewhere, _ = wheel_env
    base = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone(), "b": base["b"].clone()}
    new["w"][3] = 7.5
    save_file(base, tmp_path / "A.safetensors")
    save_file(new, tmp_path / "B.safetensors")
    frame = tmp_path / "D"
    # the frame is made here (this venv has torch), read there (that one has neither torch nor a key)
    made = _run(
        [sys.executable, "-m", "modal_rl.weightsync", "encode", "--keyless"]
        + ["--base", tmp_path / "A.safetensors", "--new", tmp_path / "B.safetensors", "--out", frame],
        cwd=ROOT,
    )
    assert made.returncode == 0, made.stderr
    r = _in_venv(venv, elsewhere, "weightsync", "inspect", str(frame), "--keyless")
    assert r.returncode == 0 and "delta version 1 (base 0): 2 tensors" in r.stdout, r.stderr
    r = _in_venv(
        venv,
        elsewhere,
        *("weightsync", "encode", "--keyless", "--new", str(tmp_path / "B.safetensors"), "--out"),
        str(tmp_path / "E"),
    )
    assert r.returncode == 2 and "'torch'" in r.stderr and "pip install torch" in r.stderr, r.stderr
    assert not (tmp_path / "E").exists()


def test_this_environment_knows_the_console_script():
    """The editable install of the checkout declares the same command."""
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("modal-rl") == "modal_rl.cli.main:main"
