"""The Modal engine pool's own logic, run here with fakes only at the Modal server boundary:
``modal.forward`` (a tunnel that is the port itself), a dict as the ``modal.Dict`` mailbox,
and function calls that report "still running" or a failure. The engine is a real process."""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path

import pytest

from modal_rl.cluster import engines_modal
from modal_rl.cluster.backend_local import free_ports
from modal_rl.cluster.engines import EngineSpec, EngineStartError, probe

SERVER = str(Path(__file__).with_name("_engine_server.py"))


class FakeTunnel:
    def __init__(self, port: int):
        self.tcp_socket = ("127.0.0.1", port)


@pytest.fixture
def container(monkeypatch):
    """engine_container_main as Modal would run it, on 127.0.0.1 and with a local 'tunnel'."""
    import modal

    monkeypatch.setattr(engines_modal, "CONTAINER_HOST", "127.0.0.1")
    monkeypatch.setattr(engines_modal, "CONTAINER_POLL_S", 0.1)
    monkeypatch.setattr(
        modal, "forward", lambda port, unencrypted=False: contextlib.nullcontext(FakeTunnel(port))
    )


def spec_for(tmp_path, mode="ok", **kw) -> EngineSpec:
    (port,) = free_ports(1, "127.0.0.1")
    cmd = [
        sys.executable,
        SERVER,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--mode",
        mode,
        "--state",
        str(tmp_path),
    ]
    return EngineSpec(command=cmd, port=port, **kw)


def test_container_reports_its_address_serves_and_stops_on_request(container, tmp_path):
    spec, mailbox, result = spec_for(tmp_path), {}, {}
    body = threading.Thread(
        target=lambda: result.update(engines_modal.engine_container_main(spec.to_dict(), 0, mailbox))
    )
    body.start()
    try:
        for _ in range(100):
            if "addr/0" in mailbox:
                break
            body.join(0.1)
        assert mailbox["addr/0"] == f"http://127.0.0.1:{spec.port}"
        assert probe(mailbox["addr/0"] + "/health")[0]
    finally:
        mailbox["stop"] = True
        body.join(30)
    assert not body.is_alive() and result["index"] == 0
    assert not probe(f"http://127.0.0.1:{spec.port}/health", timeout_s=0.5)[0]  # server ended with it


def test_container_reports_a_crash_with_its_last_lines(container, tmp_path):
    mailbox: dict = {}
    out = engines_modal.engine_container_main(spec_for(tmp_path, mode="crash").to_dict(), 3, mailbox)
    assert out["exit"] == "exited with code 3"
    assert mailbox["error/3"]["why"] == "exited with code 3"
    assert "RuntimeError: could not load model weights" in mailbox["error/3"]["tail"]


class RunningCall:
    def __init__(self):
        self.cancelled = False

    def get(self, timeout=None):
        raise TimeoutError

    def cancel(self, terminate_containers=False):
        self.cancelled = terminate_containers


class FailedCall(RunningCall):
    def get(self, timeout=None):
        raise RuntimeError("container OOM-killed")


def pool_waiting_on(spec, mailbox, calls):
    pool = engines_modal.ModalEnginePool(spec, poll_s=0.05, grace_s=0.1)
    pool._mailbox, pool.calls = mailbox, calls
    return pool


def test_pool_raises_an_engines_reported_error_and_stops_every_call(tmp_path):
    spec = EngineSpec(command=["x"], count=2, startup_timeout_s=5)
    mailbox = {"error/1": {"why": "exited with code 1", "tail": ["CUDA out of memory"]}}
    calls = [RunningCall(), RunningCall()]
    pool = pool_waiting_on(spec, mailbox, calls)
    with pytest.raises(
        EngineStartError, match="engine 1 exited with code 1; its last lines:\n  | CUDA out of memory"
    ):
        pool._wait_all()
    pool.stop()
    assert mailbox["stop"] is True and all(c.cancelled for c in calls) and pool.calls == []


def test_pool_raises_when_a_container_fails(tmp_path):
    pool = pool_waiting_on(EngineSpec(command=["x"], count=2), {}, [RunningCall(), FailedCall()])
    with pytest.raises(EngineStartError, match="engine 1 container failed: RuntimeError"):
        pool._wait_all()


def test_pool_waits_for_health_through_the_tunnel_then_times_out(container, tmp_path):
    spec = spec_for(tmp_path, startup_timeout_s=1.0, count=2)
    # Engine 0 is up and reachable; engine 1 never reports an address.
    mailbox: dict = {}
    body = threading.Thread(target=engines_modal.engine_container_main, args=(spec.to_dict(), 0, mailbox))
    body.start()
    try:
        pool = pool_waiting_on(spec, mailbox, [RunningCall(), RunningCall()])
        with pytest.raises(EngineStartError, match=r"engine 1 \(and 0 more\) not reachable within 1 s"):
            pool._wait_all()
    finally:
        mailbox["stop"] = True
        body.join(30)
