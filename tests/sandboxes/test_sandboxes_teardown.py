"""Leak-proof teardown: signals, a killed pool process, and the orphan sweep CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.sandboxes import live_records
from tests._sandboxes_helpers import alive, descendants, needs_bwrap, wait_gone

pytestmark = needs_bwrap
ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parents[1].joinpath("_sandboxes_pool_child.py")


def start_child(tmp_path, run_id, mode):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path), run_id, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    assert line, "pool child died before reporting"
    pids = json.loads(line)["pids"]
    assert len(pids) >= 3 and all(alive(p) for p in pids)
    return proc, pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down_every_sandbox(tmp_path, sig):
    proc, pids = start_child(tmp_path, f"sig-{sig}", "signals")
    proc.send_signal(sig)
    proc.wait(timeout=20)
    assert not wait_gone(pids), "sandboxes survived the signal"
    assert not list(tmp_path.glob("*.json")), "registry entries left after signal teardown"


def test_a_pool_abandoned_with_its_event_loop_ends_its_sandboxes(tmp_path):
    # asyncio.run cancels the sandboxes' reader tasks; each must end its sandbox rather than
    # wait forever for a process nobody will stop (which would hang the loop's shutdown).
    proc, pids = start_child(tmp_path, "abandon", "abandon")
    proc.stdin.write("go\n")
    proc.stdin.close()
    proc.wait(timeout=30)
    assert proc.returncode == 0
    assert not wait_gone(pids), "sandboxes survived their event loop"


def test_killed_pool_process_takes_sandboxes_down(tmp_path):
    proc, pids = start_child(tmp_path, "sigkill", "plain")
    proc.kill()  # no handler runs: bwrap's --die-with-parent must do it
    proc.wait(timeout=20)
    assert not wait_gone(pids)
    # The registry still lists them (nobody could clean up); a sweep removes the stale entries.
    assert live_records.sweep(tmp_path, {"modal-rl-run": "sigkill"}) == 0
    assert not list(tmp_path.glob("*.json"))


def test_killed_pool_process_takes_down_even_frozen_sandboxes(tmp_path):
    proc, pids = start_child(tmp_path, "frozen", "plain")
    inner = set().union(*(descendants(p) for p in pids))
    assert inner
    for pid in inner:  # a frozen agent cannot notice its host went away
        os.kill(pid, signal.SIGSTOP)
    proc.kill()
    proc.wait(timeout=20)
    assert not wait_gone(set(pids) | inner), "frozen sandboxes outlived their pool process"
    live_records.sweep(tmp_path, {"modal-rl-run": "frozen"})


def test_sweep_cli_kills_orphans_of_a_wedged_run(tmp_path):
    proc, pids = start_child(tmp_path, "wedged", "hang")
    other, other_pids = start_child(tmp_path / "x", "other-run", "plain")
    try:
        cmd = [
            sys.executable,
            "-m",
            "modal_rl.sandboxes",
            "sweep",
            "--tag",
            "modal-rl-run=wedged",
            "--registry",
            str(tmp_path),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        swept = int(out.stdout.split()[1])
        assert swept >= len(pids)  # the warm ones and the leased one (+ any refill in flight)
        assert not wait_gone(pids)
        assert all(alive(p) for p in other_pids), "sweep touched another run's sandboxes"
        bad = subprocess.run(
            [sys.executable, "-m", "modal_rl.sandboxes", "sweep", "--tag", "novalue"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
    finally:
        for p in (proc, other):
            p.kill()
            p.wait(timeout=20)
    assert not wait_gone(other_pids)


def test_sweep_refuses_empty_tags(tmp_path):
    with pytest.raises(ValueError, match="at least one tag"):
        live_records.sweep(tmp_path, {})
