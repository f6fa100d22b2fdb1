"""The shared pieces that replaced our own code: one token bucket, one post-import hook,
psutil for processes and interfaces, Hydra's override parser."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from modal_rl.cluster import netif, procs
from modal_rl.ratelimit import FileTokenBucket, TokenBucket


def test_unlimited_bucket_never_waits():
    bucket = TokenBucket(None)
    started = time.monotonic()
    for _ in range(1000):
        assert bucket.acquire_blocking(10**9) == 0.0
    bucket.penalize(5.0)  # nothing to penalize without a rate
    assert asyncio.run(bucket.acquire(10**9)) == 0.0
    assert time.monotonic() - started < 1.0
    with pytest.raises(ValueError):
        FileTokenBucket("/nonexistent/never-made", None)


def test_requests_larger_than_the_burst_pass_at_the_rate_across_threads():
    bucket = TokenBucket(200_000, burst=10_000)  # every request is 3x the burst

    def worker():
        for _ in range(5):
            bucket.acquire_blocking(30_000)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    # Each request waits for a full burst, then leaves a 20 kB debt: the 9 after the first
    # wait 30 kB / 200 kB/s = 0.15 s each (1.35 s), whatever the thread; a stall would be longer.
    assert 1.3 <= elapsed < 6.0


def test_a_penalty_also_holds_requests_already_waiting():
    async def main():
        bucket = TokenBucket(rate=10, burst=1)
        await bucket.acquire()  # empty now: the next token comes in 0.1 s
        waiter = asyncio.create_task(bucket.acquire())
        await asyncio.sleep(0.02)
        bucket.penalize(0.5)  # the provider said "rate limited" while the waiter waits
        started = time.monotonic()
        await waiter
        return time.monotonic() - started

    assert asyncio.run(main()) >= 0.45


def test_post_import_hook_runs_after_a_submodule_executes(tmp_path, monkeypatch):
    from verl_modal import _post_import

    pkg = tmp_path / "tooling_pi_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    _post_import.after_import(
        "tooling_pi_pkg.mod", lambda: seen.append(sys.modules["tooling_pi_pkg.mod"].VALUE)
    )
    assert seen == [] and _post_import.pending("tooling_pi_pkg.mod")
    importlib.import_module("tooling_pi_pkg.mod")  # not an import statement: no distribution to declare
    assert seen == [7] and not _post_import.pending("tooling_pi_pkg.mod")
    for name in ("tooling_pi_pkg.mod", "tooling_pi_pkg"):
        monkeypatch.delitem(sys.modules, name)


def test_interfaces_come_from_the_kernel():
    assert netif.interface_for("127.0.0.1") == "lo"
    assert netif.interface_for("127.1.2.3") == "lo"  # in 127.0.0.0/8
    try:
        has_v6 = bool(netif._networks(6))
    except ValueError:
        has_v6 = False
    if has_v6:
        assert netif.interface_for("::1") == "lo"
    with pytest.raises(LookupError, match="198.51.100.7"):
        netif.interface_for("198.51.100.7")  # TEST-NET-2: held by no interface here


def test_processes_of_a_run_are_found_by_environment_and_ended():
    run_id = f"tooling-{uuid.uuid4()}"
    child = subprocess.Popen(
        ["sh", "-c", "sleep 60 & wait"], env={**os.environ, procs.RUN_ID_ENV: run_id}, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 10
        while len(procs.pids_of_run(run_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = procs.pids_of_run(run_id)
        assert child.pid in found and len(found) == 2  # the shell and its sleep
        assert set(procs.children_of(child.pid)) == set(found) - {child.pid}
        assert procs.end_run(run_id, grace_s=2.0) == []
        child.wait(timeout=10)
        assert procs.alive(found) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_override_keys_are_read_by_hydras_parser():
    from verl_modal.cpu import overrides as ov

    assert ov.override_key("+data@train=gsm8k") == "data@train"
    assert ov.override_key("a.b=[1,2,{c: 3}]") == "a.b"
    with pytest.raises(ov.OverrideError, match=r"'a\.\.b=1' \(.+\)"):  # Hydra's reason in brackets
        ov.override_key("a..b=1")
