"""The sweep registry trusts nothing it did not write: planted entries kill nothing, and a
registry dir that is not private to the user is refused. (The sweep of real orphaned
sandboxes: tests/sandboxes/test_sandboxes_teardown.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.sandboxes import LocalProvider, ProviderUnavailableError, SandboxSpec, live_records
from modal_rl.sandboxes.ratelimit import host_bucket
from tests._sandboxes_helpers import alive, needs_bwrap, sandbox_processes, wait_gone
from tests.conftest import leftovers

ROOT = Path(__file__).resolve().parents[2]
TAGS = {"modal-rl-run": "planted"}


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start(*, own_group: bool) -> subprocess.Popen:
        p = subprocess.Popen(["sleep", "120"], start_new_session=own_group)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def plant(registry_dir: Path, name: str, **entry) -> None:
    live_records.open_dir(registry_dir)
    (registry_dir / f"{name}.json").write_text(json.dumps({"id": name, "tags": TAGS, **entry}))


def sweep_cli(registry_dir, *tags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "modal_rl.sandboxes", "sweep", "--registry", str(registry_dir)]
    for tag in tags or ("modal-rl-run=planted",):
        cmd += ["--tag", tag]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_planted_entries_kill_nothing_and_are_reported(tmp_path, procs, caplog):
    victim = procs(own_group=True)  # a process group the entries never owned
    other = procs(own_group=False)  # a live process in this test's group, not a group leader
    start = live_records.proc_starttime
    plant(tmp_path, "foreign-pgid", pid=other.pid, pgid=victim.pid, starttime=start(other.pid))
    plant(tmp_path, "not-a-leader", pid=other.pid, pgid=other.pid, starttime=start(other.pid))
    plant(tmp_path, "wrong-start", pid=victim.pid, pgid=victim.pid, starttime=start(victim.pid) - 5)
    plant(tmp_path, "own-group", pid=os.getpid(), pgid=0, starttime=start(os.getpid()))
    plant(tmp_path, "malformed", pid="1", pgid=victim.pid, starttime=None)
    plant(
        tmp_path, "other-tags", pid=victim.pid, pgid=victim.pid, starttime=start(victim.pid), tags={"x": "y"}
    )
    with caplog.at_level(logging.WARNING, logger=live_records.__name__):
        assert live_records.sweep(tmp_path, TAGS) == 0
    assert alive(victim.pid) and alive(other.pid)
    assert sorted(r.id for r in _refused(caplog)) == [
        "foreign-pgid",
        "malformed",
        "not-a-leader",
        "own-group",
        "wrong-start",
    ]
    # refused entries are gone; another run's entry was not even looked at
    assert [p.stem for p in tmp_path.glob("*.json")] == ["other-tags"]


def _refused(caplog) -> list[live_records.RefusedEntry]:
    out = []
    for rec in caplog.records:
        _, _, rest = rec.getMessage().partition("refused entry ")
        name, _, reason = rest.partition(": ")
        out.append(live_records.RefusedEntry(name, reason))
    return out


def test_cli_prints_refused_entries_and_still_kills_a_real_one(tmp_path, procs):
    victim, real = procs(own_group=True), procs(own_group=True)
    plant(tmp_path, "planted", pid=real.pid, pgid=victim.pid, starttime=live_records.proc_starttime(real.pid))
    live_records.register(tmp_path, "real", real.pid, TAGS)  # leads its own group: a sandbox's shape
    out = sweep_cli(tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("swept 1 sandbox(es)")
    assert len(lines) == 2 and lines[1].startswith(
        f"refused planted: pgid {victim.pid} is not its pid {real.pid}"
    )
    assert not wait_gone({real.pid}) and alive(victim.pid)
    assert not list(tmp_path.glob("*.json"))


def _open_dir(tmp_path: Path) -> Path:
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o777)
    return path


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_registry_writable_by_others_is_refused(tmp_path, procs, mode):
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(mode)
    victim = procs(own_group=True)
    (path / "x.json").write_text(
        json.dumps(
            {
                "id": "x",
                "pid": victim.pid,
                "pgid": victim.pid,
                "starttime": live_records.proc_starttime(victim.pid),
                "tags": TAGS,
            }
        )
    )
    for call in (lambda: live_records.sweep(path, TAGS), lambda: live_records.entries(path)):
        with pytest.raises(
            live_records.RegistryRefusedError, match=f"{path} is writable by group or others.*chmod 700"
        ):
            call()
    with pytest.raises(ProviderUnavailableError, match="writable by group or others"):
        live_records.register(path, "y", os.getpid(), TAGS)
    assert alive(victim.pid)
    out = sweep_cli(path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out
    assert str(path) in out.stderr and "chmod 700" in out.stderr
    path.chmod(0o755)  # others may read: fine, only writing matters
    assert live_records.entries(path)[0]["id"] == "x"


def test_a_registry_owned_by_another_user_is_refused(tmp_path):
    me = os.geteuid()
    if me != 0:  # only root can give a dir away; any other user meets one of root's
        with pytest.raises(live_records.RegistryRefusedError, match=rf"owned by uid 0, not you \(uid {me}\)"):
            live_records.entries(Path("/"))
        return
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    with pytest.raises(
        live_records.RegistryRefusedError,
        match=rf"{path} is owned by uid 65534, not you \(uid 0\); remove it",
    ):
        live_records.sweep(path, TAGS)
    link = tmp_path / "link"
    link.symlink_to(live_records.open_dir(tmp_path / "mine"))
    assert live_records.entries(link) == []  # our own symlink to our own dir: fine
    os.lchown(link, 65534, 65534)
    with pytest.raises(live_records.RegistryRefusedError, match="is a symlink owned by uid 65534"):
        live_records.entries(link)


@needs_bwrap
def test_a_provider_refuses_a_shared_registry_before_starting_anything(tmp_path):
    provider = LocalProvider(registry_dir=_open_dir(tmp_path))

    async def main():
        with pytest.raises(ProviderUnavailableError, match="writable by group or others"):
            await provider.create(SandboxSpec(), tags=TAGS)
        assert not sandbox_processes()

    asyncio.run(main())


def test_registry_dir_is_per_user_private_and_allowed_by_the_tmp_check(tmp_path, monkeypatch):
    monkeypatch.delenv(live_records.ENV, raising=False)
    assert live_records.default_dir() == Path(f"/tmp/modal-rl-sandboxes-{os.geteuid()}")
    assert leftovers(set(), {live_records.default_dir().name}) == []  # tests/conftest.py allows it
    monkeypatch.setenv(live_records.ENV, str(tmp_path / "reg"))
    assert live_records.default_dir() == tmp_path / "reg"
    old = os.umask(0)
    try:
        made = live_records.open_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_the_host_rate_limiter_lives_in_the_private_registry(tmp_path, monkeypatch):
    monkeypatch.setenv(live_records.ENV, str(tmp_path / "reg"))
    bucket = host_bucket("local", 100.0, 5)
    assert bucket.path == tmp_path / "reg" / "ratelimit-local.json"
    assert bucket.acquire_blocking() == 0.0
    assert stat.S_IMODE((tmp_path / "reg").stat().st_mode) == 0o700
    monkeypatch.setenv(live_records.ENV, str(_open_dir(tmp_path)))
    with pytest.raises(live_records.RegistryRefusedError):
        host_bucket("local", 100.0, 5)
