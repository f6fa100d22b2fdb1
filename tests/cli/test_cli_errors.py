"""Every user-facing failure of the four entry points is one line with the right exit code.

Each case runs the real entry point in a subprocess, as a user would. No Modal server is
reachable and none is contacted: the no-credentials case fails before any network call, and
the no-route case points ``MODAL_SERVER_URL`` at a closed port on 127.0.0.1.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ENTRY_POINTS = {
    "verl_modal": ["verl_modal", "--backend", "modal", "--gpu", "H100:8", "--", "trainer.total_epochs=1"],
    "slime_modal": ["slime_modal", "--backend", "modal", "--gpu", "H100:8", "--", "--colocate"],
    "cluster smoke": ["modal_rl.cluster", "smoke", "--backend", "modal", "--gpu", "H100:8"],
    "sandboxes sweep": ["modal_rl.sandboxes", "sweep", "--provider", "modal", "--tag", "modal-rl-run=r1"],
}


def no_modal_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The user's env without any Modal credentials or config file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env.update(
        {
            "HOME": str(tmp_path),  # no ~/.modal.toml
            "MODAL_CONFIG_PATH": str(tmp_path / "no-modal.toml"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
            "RAY_AUTH_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
        }
    )
    env.update(extra)
    return env


def run(
    argv: list[str], env: dict[str, str], timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float, float]:
    """``(process, wall seconds, CPU seconds of the child)``; CPU time does not grow when
    other jobs share the cores, so it is what the time limits are checked against."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out, wall, cpu


def one_line(out: subprocess.CompletedProcess, prog: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == "", (out.stdout, out.stderr)
    assert lines[0].startswith(f"{prog}: "), lines[0]
    return lines[0]


def closed_port() -> int:
    from modal_rl.cluster.ports import reserve

    return reserve(1)[0]  # claimed and never bound: a connect is refused


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_no_modal_token_is_one_line_exit_2_before_anything_else(name, tmp_path):
    argv = ENTRY_POINTS[name]
    out, wall, cpu = run(argv, no_modal_env(tmp_path))
    assert out.returncode == 2, out.stderr
    line = one_line(out, argv[0])
    assert "no Modal credentials" in line and "MODAL_TOKEN_ID" in line and "modal token new" in line
    assert cpu < 2.0, f"{cpu:.2f} s of CPU"  # verl's preflight (10+ s) never ran
    assert wall < 15.0, f"{wall:.1f} s"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_no_route_to_modal_is_one_line_exit_1(name, tmp_path):
    port = closed_port()
    env = no_modal_env(
        tmp_path,
        MODAL_TOKEN_ID="ak-test",
        MODAL_TOKEN_SECRET="as-test",
        MODAL_SERVER_URL=f"http://127.0.0.1:{port}",
    )
    argv = ENTRY_POINTS[name]
    out, wall, cpu = run(argv, env)
    assert out.returncode == 1, out.stderr
    line = one_line(out, argv[0])
    assert f"cannot reach the Modal server (127.0.0.1:{port} connection refused)" in line, line
    assert "MODAL_SERVER_URL" in line
    assert cpu < 2.0 and wall < 15.0, (cpu, wall)


def test_a_config_file_without_a_token_is_read_the_clients_way(tmp_path):
    # Without a file the check answers before importing modal; with one, modal.config reads it.
    config = tmp_path / "modal.toml"
    config.write_text('[default]\nactive = true\nloglevel = "WARNING"\n')
    out, _, _ = run(ENTRY_POINTS["sandboxes sweep"], no_modal_env(tmp_path, MODAL_CONFIG_PATH=str(config)))
    assert out.returncode == 2
    line = one_line(out, "modal_rl.sandboxes")
    assert "no Modal credentials" in line and str(config) in line, line


def test_half_a_token_and_an_unknown_profile_are_named(tmp_path):
    out, _, _ = run(ENTRY_POINTS["sandboxes sweep"], no_modal_env(tmp_path, MODAL_TOKEN_ID="ak-test"))
    assert out.returncode == 2
    assert "MODAL_TOKEN_ID is set but MODAL_TOKEN_SECRET is not" in one_line(out, "modal_rl.sandboxes")
    out, _, _ = run(ENTRY_POINTS["sandboxes sweep"], no_modal_env(tmp_path, MODAL_PROFILE="nope"))
    assert out.returncode == 2
    assert "Modal profile 'nope' (MODAL_PROFILE) is not in" in one_line(out, "modal_rl.sandboxes")


def test_dry_run_needs_no_modal_account(tmp_path):
    argv = [
        "modal_rl.cluster",
        "run",
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--dry-run",
        "--json",
        "--",
        "true",
    ]
    out, _, _ = run(argv, no_modal_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert '"backend": "modal"' in out.stdout


@pytest.mark.parametrize(
    ("tiny", "says"),
    [
        ("README.md", "--tiny README.md: that is a file, not a directory"),
        ("/proc/nope", "--tiny /proc/nope: cannot make that directory"),
    ],
)
def test_tiny_dir_that_cannot_be_one(tiny, says, tmp_path):
    out, _, cpu = run(["verl_modal", "--tiny", tiny, "--"], no_modal_env(tmp_path))
    assert out.returncode == 2
    line = one_line(out, "verl_modal")
    assert line.startswith(f"verl_modal: {says}") and "e.g. --tiny runs/verl-cpu/tiny" in line
    assert cpu < 2.0  # checked before torch or verl is imported


def test_a_word_where_verl_wants_a_number(tmp_path):
    out, _, _ = run(
        ["verl_modal", "--device", "cpu", "--", "actor_rollout_ref.rollout.n=two"], no_modal_env(tmp_path)
    )
    assert out.returncode == 2
    assert one_line(out, "verl_modal") == (
        "verl_modal: actor_rollout_ref.rollout.n=two: verl expects an integer there (its default is 1); fix the value"
    )


@pytest.mark.slow  # imports torch twice: 5-15 s on a shared 2-core machine
def test_device_gpu_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out, _, _ = run(["verl_modal", "--device", "gpu", "--"], no_modal_env(tmp_path))
    assert out.returncode == 2
    line = one_line(out, "verl_modal")
    assert line.startswith("verl_modal: --device gpu: torch sees no GPU on this machine")
    assert "--device cpu" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["verl_modal", "--nodes", "two", "--"],
        ["slime_modal", "--nodes", "two", "--"],
        ["modal_rl.cluster", "smoke", "--nodes", "two"],
        ["modal_rl.sandboxes", "sweep", "--tag", "novalue"],
    ],
    ids=["verl", "slime", "cluster", "sandboxes"],
)
def test_bad_flags_are_one_line_exit_2(argv, tmp_path):
    out, _, _ = run(argv, no_modal_env(tmp_path))
    assert out.returncode == 2
    line = one_line(out, argv[0])
    assert "invalid int value: 'two'" in line or "tags are KEY=VALUE" in line, line
    assert line.endswith("--help)")


def test_an_unexpected_failure_is_one_line_exit_1_and_debug_adds_the_traceback(tmp_path):
    code = (
        "import sys; from modal_rl.cli_errors import run_main\n"
        "def main(argv): raise RuntimeError('disk on fire\\nsecond line')\n"
        "sys.exit(run_main('prog', main))\n"
    )
    for debug in ([], ["--debug"]):
        out = subprocess.run(
            [sys.executable, "-c", code, *debug],
            cwd=ROOT,
            env=no_modal_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1
        last = out.stderr.strip().splitlines()[-1]
        assert (
            last
            == "prog: failed: RuntimeError: disk on fire second line (rerun with --debug for the traceback)"
        )
        assert ("Traceback" in out.stderr) == bool(debug)
