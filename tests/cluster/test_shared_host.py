"""Round 3 (issue 35), item 6: shared hosts — another user on the machine.

This suite runs as root in CI's container, so "another user" is a directory chowned to
``nobody`` (65534). Run dirs are 0700 and refused when another user made them; marks and
locks are never written through a planted link; a process group is signalled only while
its leader is still the process we started (pid reuse).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from modal_rl import run_temp
from modal_rl.cluster import procs
from modal_rl.engines import pool_local as engine_local
from modal_rl.weightsync.transport import volumes

NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@needs_root
def test_a_named_run_dir_another_user_made_first_is_refused(tmp_path):
    planted = tmp_path / "mrl-run1"
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(run_temp.ForeignDirError) as info:
        run_temp.own(planted)
    assert "owned by uid 65534" in str(info.value) and "\n" not in str(info.value)
    assert str(planted) not in run_temp._owned


def test_a_run_dir_is_private_even_when_it_existed(tmp_path):
    existing = tmp_path / "mrl-run2"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    made = None
    try:
        run_temp.own(existing)
        assert mode(existing) == 0o700
        assert mode(existing / run_temp.OWNER_FILE) == 0o600
        made = run_temp.make("t")
        assert mode(made) == 0o700
    finally:
        run_temp.remove(existing)
        if made is not None:
            run_temp.remove(made)  # in the temp dir itself: CI's temp check counts what is left


def test_a_link_at_a_run_dir_name_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "mrl-run3").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(run_temp.ForeignDirError, match="not a directory"):
        run_temp.own(tmp_path / "mrl-run3")


def test_the_owner_mark_is_never_written_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run_dir = tmp_path / "mrl-run4"
    run_dir.mkdir(mode=0o700)
    (run_dir / run_temp.OWNER_FILE).symlink_to(victim)
    try:
        run_temp.own(run_dir)
        assert victim.read_text() == "precious\n"
        mark = run_dir / run_temp.OWNER_FILE
        assert not mark.is_symlink() and mark.read_text().split()[0] == str(os.getpid())
    finally:
        run_temp.remove(run_dir)


@needs_root
def test_sweep_leaves_another_users_run_dirs_alone(tmp_path):
    theirs = tmp_path / "mrl-theirs"
    theirs.mkdir()
    (theirs / run_temp.OWNER_FILE).write_text("999999999 1\n")  # a dead owner
    os.chown(theirs, NOBODY, NOBODY)
    mine = tmp_path / "mrl-mine"
    mine.mkdir()
    (mine / run_temp.OWNER_FILE).write_text("999999999 1\n")
    assert run_temp.sweep(str(tmp_path)) == [str(mine)]
    assert theirs.is_dir()


@needs_root
def test_the_publish_lock_is_per_user_and_never_another_users(tmp_path, monkeypatch):
    data = tmp_path / "ckpt"
    data.mkdir()
    (data / "w.bin").write_bytes(b"x" * 10)
    shared = tmp_path / "state"
    shared.mkdir(mode=0o777)
    os.chown(shared, NOBODY, NOBODY)
    monkeypatch.setenv(volumes.NODE_STATE_ENV, str(shared))
    with pytest.raises(run_temp.ForeignDirError):
        volumes.publish(data)
    monkeypatch.delenv(volumes.NODE_STATE_ENV)
    monkeypatch.setattr(volumes.tempfile, "gettempdir", lambda: str(tmp_path))
    assert volumes.publish(data)
    (state,) = [p for p in tmp_path.iterdir() if p.name.startswith("modal-rl-publish")]
    assert state.name == f"modal-rl-publish-{os.getuid()}" and mode(state) == 0o700
    assert all(mode(p) == 0o600 or p.suffix != ".lock" for p in state.iterdir())


def test_a_reused_pid_is_never_signalled_as_our_engines_group():
    """Our engine exited and was reaped; its pid now leads someone else's process group (pid
    reuse, simulated by pointing the old handle at a live stranger). Nothing is signalled."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"], start_new_session=True)
    procs.remember_start(ours)
    ours.wait()  # reaped: the pid is free for anyone
    ours.pid = stranger.pid  # ... and a stranger got it
    try:
        engine_local._kill_group(ours)
        assert not procs.signal_group(ours, signal.SIGTERM)
        time.sleep(0.3)
        assert stranger.poll() is None, "a stranger's process group was killed"
    finally:
        stranger.kill()
        stranger.wait()


def test_our_live_engines_group_is_still_ended():
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
        ],
        start_new_session=True,
    )
    procs.remember_start(leader)
    time.sleep(0.5)
    members = procs.children_of(leader.pid)
    engine_local._kill_group(leader)
    assert leader.returncode is not None
    time.sleep(0.3)
    assert procs.alive(members) == []
