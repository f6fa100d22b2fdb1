"""Ctrl-C during a local verl run: one line, exit 130, and nothing of the run left running.

A real run (``python -m verl_modal --tiny ...``) is interrupted the way a terminal does it:
SIGINT to its whole process group, once verl's TaskRunner (a Ray worker) is up. Every
process the run started (Ray's GCS and raylet, its workers, whatever they started) is
recorded while it runs, by PID, and must be gone afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
READY = "verl's TaskRunner is up"


def still_running(procs: dict[int, psutil.Process]) -> list[str]:
    alive = []
    for proc in procs.values():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_is_one_line_exit_130_and_stops_everything(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "VLLM_"))}
    env.update({"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
    argv = ["--tiny", str(tmp_path / "tiny"), "--log-dir", str(tmp_path / "logs"), "--"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_modal", *argv, "trainer.total_training_steps=1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    started: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 600
    try:
        while not any(READY in line for line in lines):
            assert proc.poll() is None, "".join(lines) + proc.stderr.read()
            assert time.monotonic() < deadline, "".join(lines)
            started.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
            time.sleep(0.3)
        time.sleep(2)  # the TaskRunner is starting verl's workers now
        started.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
        assert len(started) >= 3, started  # Ray's GCS, raylet and workers at least
        os.killpg(proc.pid, signal.SIGINT)
        err = proc.stderr.read()
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    assert code == 130, err
    assert err.strip().splitlines() == [
        "verl_modal: interrupted (Ctrl-C); everything this run started was stopped"
    ], err
    assert "Traceback" not in "".join(lines)
    # Ray's processes end asynchronously after its shutdown returned: give them a moment.
    give_up = time.monotonic() + 15
    while still_running(started) and time.monotonic() < give_up:
        time.sleep(0.5)
    assert still_running(started) == []
