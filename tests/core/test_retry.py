"""``modal_rl.retry.wait_for``: the one poll-until-deadline loop (its callers' own tests
cover each use: tests/core/test_modal_check*, tests/weightsync volume and lease tests,
tests/cluster procs and control tests, tests/engines forwarded-pool and Modal container
tests)."""

from __future__ import annotations

import time

import pytest

from modal_rl.retry import wait_for


def test_returns_the_first_truthy_result():
    calls = iter([None, 0, "", {"ok": 1}, "later"])
    assert wait_for(lambda: next(calls), 5, poll_s=0.001) == {"ok": 1}


def test_times_out_with_none_after_one_last_look_and_no_oversleep():
    seen = []
    t0 = time.monotonic()
    assert wait_for(lambda: seen.append(time.monotonic()), 0.2, poll_s=0.15) is None
    took = time.monotonic() - t0
    assert 0.2 <= took < 2.0  # loaded hosts are slow, never early
    assert len(seen) >= 2 and seen[-1] - t0 >= 0.2  # the last look is at or after the deadline


def test_zero_timeout_still_checks_once_and_errors_pass_through():
    assert wait_for(lambda: 7, 0) == 7
    assert wait_for(lambda: False, 0) is None

    def broken():
        raise OSError("boom")

    with pytest.raises(OSError, match="boom"):
        wait_for(broken, 1)
    with pytest.raises(ValueError, match="poll_s"):
        wait_for(lambda: True, 1, poll_s=0)


def test_modal_reachability_waits_for_a_real_listener_and_names_a_refusal():
    import socket

    from modal_rl.modal_check import reachability_problem

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert reachability_problem(f"http://127.0.0.1:{port}", timeout_s=5) is None
    got = reachability_problem(f"http://127.0.0.1:{port}", timeout_s=5)  # closed now
    assert got.startswith("cannot reach the Modal server (127.0.0.1:") and "refused" in got


def test_await_visible_returns_once_complete_and_names_what_is_missing(tmp_path, monkeypatch):
    import threading

    from modal_rl.weightsync.transport.volumes import NODE_STATE_ENV, await_visible, publish

    monkeypatch.setenv(NODE_STATE_ENV, str(tmp_path / "node-state"))  # publish's lock, not in TMPDIR
    tmp_path = tmp_path / "state"
    tmp_path.mkdir()
    (tmp_path / "a.bin").write_bytes(b"x")
    assert publish(tmp_path)  # this node's marker lists a.bin
    with pytest.raises(TimeoutError, match=r"not complete after 0.3s; missing: b.bin \(required\)"):
        await_visible(tmp_path, ["b.bin"], timeout_s=0.3, poll_s=0.05)
    later = threading.Timer(0.2, lambda: (tmp_path / "b.bin").write_bytes(b"y"))
    later.start()
    await_visible(tmp_path, ["b.bin"], timeout_s=10, poll_s=0.05)
    later.join()


def test_a_lease_wait_takes_a_lapsed_lease_and_names_a_live_holder(tmp_path):
    from modal_rl.weightsync.errors import LeaseHeldError
    from modal_rl.weightsync.transport.lease import StoreLease

    def lease(ttl_s: float) -> StoreLease:
        return StoreLease(
            tmp_path,
            None,
            lambda path, data: path.write_bytes(data),
            lambda: None,
            ttl_s=ttl_s,
            heartbeat=False,
        )

    first = lease(0.6)
    first.acquire("run", 1)  # no heartbeat: its lease lapses 0.6 s from now
    with pytest.raises(LeaseHeldError, match=f"is leased to .*{first.holder}.*Stop it"):
        lease(30).acquire("run", 2, wait_s=0.1)
    t0 = time.monotonic()
    second = lease(30)
    epoch = second.acquire("run", 2, wait_s=20)  # waits for the lapse, then takes it over
    assert 0.3 < time.monotonic() - t0 < 10 and epoch >= 2 and second.read().holder == second.holder
