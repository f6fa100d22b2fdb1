"""Per-run temp directories (``modal_rl.run_temp``): what a run starts writes its temp files
into a directory the run owns, and nothing is left in the temp directory when it ends."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from modal_rl import run_temp
from modal_rl.engines.pool import EngineSpec
from modal_rl.engines.pool_local import LocalEnginePool
from modal_rl.run_key import RUN_KEY_ENV, new_run_key

SERVER = str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py"))
# The stand-in engine, started after it has left a temp file, as vLLM leaves its sockets.
LEAVES_A_FILE = (
    "import runpy, sys, tempfile\n"
    "tempfile.mkstemp(prefix='engine-leftover-')\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
CHILD_TEMP = "import tempfile; print(tempfile.gettempdir())"


def test_process_temp_moves_this_process_and_its_children_and_removes_the_dir():
    before_env, before = os.environ.get("TMPDIR"), tempfile.gettempdir()
    seen: dict = {}
    with pytest.raises(RuntimeError, match="the run failed"), run_temp.process_temp() as path:
        seen["here"] = tempfile.gettempdir()
        out = subprocess.run([sys.executable, "-c", CHILD_TEMP], capture_output=True, text=True, check=True)
        seen["child"] = out.stdout.strip()
        fd, name = tempfile.mkstemp()
        os.close(fd)
        seen["file"] = Path(name)
        raise RuntimeError("the run failed")
    assert seen["here"] == seen["child"] == str(path) and seen["file"].parent == path
    assert path.name.startswith(run_temp.PREFIX) and len(str(path)) <= run_temp.MAX_BASE_LEN + 13
    assert not path.exists()  # removed although the block raised
    assert os.environ.get("TMPDIR") == before_env and tempfile.gettempdir() == before


def test_keep_logs_keeps_the_dir(monkeypatch):
    monkeypatch.setenv(run_temp.KEEP_ENV, "1")
    with run_temp.process_temp() as path:
        pass
    try:
        assert path.is_dir()
    finally:
        monkeypatch.delenv(run_temp.KEEP_ENV)
        run_temp.remove(path)
    assert not path.exists()


def test_kernel_cache_is_not_in_the_run_dir(monkeypatch):
    monkeypatch.delenv(run_temp.KERNEL_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    env = run_temp.child_env("/tmp/mrl-x")
    assert env == {
        "TMPDIR": "/tmp/mrl-x",
        run_temp.KERNEL_CACHE_ENV: "/somewhere/cache/modal-rl/torchinductor",
        run_temp.BASE_ENV: "/tmp",
    }
    monkeypatch.setenv(run_temp.KERNEL_CACHE_ENV, "/mine")  # the user's choice stands
    assert run_temp.child_env("/tmp/mrl-x")[run_temp.KERNEL_CACHE_ENV] == "/mine"


def test_engines_write_into_the_pools_dir_which_goes_even_after_a_killed_engine(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, new_run_key())
    command = [sys.executable, "-c", LEAVES_A_FILE, SERVER, "--host", "{host}", "--port", "{port}"]
    system_temp = Path(tempfile.gettempdir())
    before = {p.name for p in system_temp.glob("engine-leftover-*")}
    pool = LocalEnginePool(EngineSpec(command=command), log_dir=str(tmp_path / "asked"))
    with pool:
        pool.replace(0)  # SIGKILL: the first engine never cleans up after itself
        left = sorted(p.name for p in pool.temp_dir.glob("engine-leftover-*"))
        assert len(left) == 2, left
    assert not pool.temp_dir.exists()
    assert (tmp_path / "asked" / "engine-0.log").exists()  # logs asked for are kept
    assert {p.name for p in system_temp.glob("engine-leftover-*")} == before


# A launcher's run (process_temp) starts a worker (as Ray starts verl's), which makes a run dir of
# its own (as an engine pool does); argv: the longest base allowed, the role.
NESTED_RUN = """import os, subprocess, sys
from modal_rl import run_temp
run_temp.MAX_BASE_LEN = int(sys.argv[1])
if sys.argv[2] == "launcher":
    with run_temp.process_temp() as run:
        argv = [sys.executable, __file__, sys.argv[1], "worker"]
        print(run, subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip())
else:
    own = run_temp.make("eng-")
    print(own)
    if sys.argv[2] == "worker":
        run_temp.remove(own)
    else:  # "killed": gone without removing it (no atexit), as a Ray worker killed at shutdown
        sys.stdout.flush()
        os._exit(0)
"""


def nested_run(tmp_path, worker: str) -> tuple[Path, Path]:
    """A launcher's run and the run dir its child (``worker``: removes it; ``killed``: leaves
    it, gone without cleanup) made inside it."""
    script = tmp_path / "nested_run.py"
    script.write_text(NESTED_RUN.replace('"worker"]', f'"{worker}"]'))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop(run_temp.BASE_ENV, None)
    out = subprocess.run(
        [sys.executable, str(script), str(len(str(tmp_path))), "launcher"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.split()
    run, worker_dir = (Path(p) for p in out)
    assert worker_dir.parent == tmp_path and worker_dir.name.startswith(f"{run_temp.PREFIX}eng-"), out
    return run, worker_dir


def test_a_worker_inside_a_run_makes_its_run_dirs_beside_the_runs_not_in_tmp(tmp_path):
    # The run dir is one level longer than its base: past the limit, where the worker used to
    # fall back to /tmp (engine pools in verl's Ray workers); it follows the launcher's base now.
    run, worker_dir = nested_run(tmp_path, "worker")
    assert run.parent == tmp_path and len(str(run)) > len(str(tmp_path))
    assert not worker_dir.exists() and not run.exists()


def test_a_run_dir_a_dead_worker_left_beside_the_run_goes_when_the_run_ends(tmp_path):
    run, worker_dir = nested_run(tmp_path, "killed")
    assert not worker_dir.exists() and not run.exists()


MAKES_A_RUN_DIR = (  # its base is TMPDIR however long (a test's tmp_path), never /tmp itself
    "import sys; from modal_rl import run_temp; run_temp.MAX_BASE_LEN = 4096; "
    "print(run_temp.make('sweeptest-'), flush=True); sys.stdin.read()"
)


def test_a_sigkilled_runs_dir_is_swept_by_the_next_run_and_a_live_or_unmarked_one_is_not(tmp_path):
    import signal

    def start():
        proc = subprocess.Popen(
            [sys.executable, "-c", MAKES_A_RUN_DIR],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        return proc, Path(proc.stdout.readline().strip())

    dead, dead_dir = start()
    live, live_dir = start()
    unmarked = Path(tempfile.mkdtemp(prefix=run_temp.PREFIX, dir=tmp_path))  # e.g. being made
    try:
        assert dead_dir.parent == tmp_path and (dead_dir / run_temp.OWNER_FILE).is_file()
        dead.send_signal(signal.SIGKILL)  # no atexit, no finally: its dir stays behind
        dead.wait()
        assert dead_dir.is_dir() and run_temp.owner_gone(dead_dir) and not run_temp.owner_gone(live_dir)
        # A fresh process's first run dir sweeps the base, as every run's start does.
        fresh, fresh_dir = start()
        fresh.communicate("")
        assert not dead_dir.exists(), "the SIGKILLed run's dir was not swept"
        assert live_dir.is_dir() and unmarked.is_dir()
        assert not fresh_dir.exists()  # removed at its own exit
    finally:
        live.communicate("")
    assert not live_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [unmarked.name]


def test_a_kept_dir_loses_its_owner_mark_and_is_never_swept(monkeypatch, tmp_path):
    monkeypatch.setenv(run_temp.KEEP_ENV, "1")
    path = run_temp.own(tmp_path / f"{run_temp.PREFIX}kept")
    assert (path / run_temp.OWNER_FILE).is_file()
    run_temp.remove(path)
    assert path.is_dir() and not (path / run_temp.OWNER_FILE).exists()
    assert run_temp.sweep(str(tmp_path)) == [] and path.is_dir()
