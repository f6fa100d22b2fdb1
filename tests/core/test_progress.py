"""Progress on long work: a bar and per-phase lines with elapsed time on a terminal (a real
pseudo-terminal here), phase and count lines without bars on a pipe, nothing when switched
off; no stretch silent past the heartbeat; the benchmark suites use it."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent(
    """
    import time
    from modal_rl.progress import bar, phase
    from benchmarks.report import progress
    with phase("making things", prefix="[t] "):
        for _ in bar(range(3), total=3, desc="cases"):
            time.sleep(0.01)
        total = sum(progress(range(4), total=4, desc="suite cases"))
    try:
        with phase("a phase that fails", prefix="[t] "):
            raise KeyError("x")
    except KeyError:
        pass
    print("RESULT", total, flush=True)
    """
)


def run_child(on_terminal: bool, env_extra: dict[str, str] | None = None) -> tuple[str, str]:
    """(stdout, stderr) of the child; on a terminal both go to one pty (returned as stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "MODAL_RL_PROGRESS"}
    env.update({"PYTHONPATH": str(ROOT), **(env_extra or {})})
    cmd = [sys.executable, "-c", CHILD]
    if not on_terminal:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    os.close(leader)
    out = b"".join(chunks).decode(errors="replace")
    return out, out


def test_a_terminal_gets_bars_and_phase_lines_with_elapsed_time():
    _, err = run_child(on_terminal=True)
    assert "[t] making things ..." in err
    assert "cases: 100%" in err and "suite cases: 100%" in err and "3/3" in err and "4/4" in err
    assert (
        "[t] making things done in " in err and " s" in err.split("making things done in ")[1].splitlines()[0]
    )
    assert "[t] a phase that fails failed after " in err
    assert "RESULT 6" in err  # the work itself is unchanged


def test_a_pipe_gets_the_results_and_nothing_for_short_work():
    out, err = run_child(on_terminal=False)
    assert out == "RESULT 6\n" and err == ""


def test_no_stretch_is_silent_longer_than_the_heartbeat(monkeypatch):
    import io
    import time

    from modal_rl import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.3)
    monkeypatch.delenv("MODAL_RL_PROGRESS", raising=False)
    log = io.StringIO()
    with progress.phase("one long step", stream=log):
        time.sleep(1.0)
    for _ in progress.bar(range(3), total=3, desc="slow cases", stream=log):
        time.sleep(0.35)
    lines = log.getvalue().splitlines()
    assert sum("one long step still running after" in line for line in lines) >= 2
    assert sum(line.startswith("slow cases: ") and " after " in line for line in lines) >= 2
    assert lines[-1].startswith("slow cases: 3/3 done in ")
    assert "%|" not in log.getvalue() and "\r" not in log.getvalue()  # no bar frames in a log


def test_the_switch_forces_progress_on_and_off():
    _, err = run_child(on_terminal=False, env_extra={"MODAL_RL_PROGRESS": "1"})
    assert "[t] making things done in " in err and "cases: 100%" in err
    _, err = run_child(on_terminal=True, env_extra={"MODAL_RL_PROGRESS": "0"})
    assert "making things" not in err and "%|" not in err
    out, err = run_child(on_terminal=False, env_extra={"MODAL_RL_PROGRESS": "0"})
    assert out == "RESULT 6\n" and err == ""
