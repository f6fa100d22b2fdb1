"""The Modal engine pool's own logic, run here with fakes only at the Modal server boundary:
``modal.forward`` (a tunnel that is the port itself; it records how it was asked for, so a
request for an unencrypted tunnel fails the tests), a dict as the ``modal.Dict`` mailbox, the
run's Modal Secret as the key in this process's environment (where Modal would put it), and
function calls that report "still running" or a failure. The engine is a real process."""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path

import pytest

from modal_rl.cluster.backend_local import free_ports
from modal_rl.engines import pool_modal as engines_modal
from modal_rl.engines.health import probe
from modal_rl.engines.pool import EngineSpec, EngineStartError
from modal_rl.run_key import ENGINE_BEARER_ENV, engine_env, new_run_key

SERVER = str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py"))


class FakeTunnel:
    """Modal's tunnel object: ``url`` for a TLS tunnel. Here it is the port itself (no TLS on
    loopback), so the address it gives is plain http on 127.0.0.1."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.tls_socket = ("127.0.0.1", port)


@pytest.fixture
def key(monkeypatch) -> str:
    """The run key; the container holds only what the run's engine Secret gives it (the engine
    bearer and the frame-read key, ``run_key.engine_env``), never the key itself."""
    value = new_run_key()
    for name, derived in engine_env(value).items():
        monkeypatch.setenv(name, derived)
    return value


@pytest.fixture
def container(monkeypatch, key) -> list:
    """engine_container_main as Modal would run it, on 127.0.0.1 and with a local 'tunnel';
    yields the calls made to ``modal.forward``."""
    import modal

    forwards: list = []

    def forward(port, *, unencrypted=False, **kw):
        forwards.append({"port": port, "unencrypted": unencrypted, **kw})
        return contextlib.nullcontext(FakeTunnel(port))

    monkeypatch.setattr(engines_modal, "CONTAINER_HOST", "127.0.0.1")
    monkeypatch.setattr(engines_modal, "CONTAINER_POLL_S", 0.1)
    monkeypatch.setattr(modal, "forward", forward)
    return forwards


def spec_for(tmp_path, mode="ok", require_key=True, **kw) -> EngineSpec:
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
    return EngineSpec(command=cmd + (["--require-key"] if require_key else []), port=port, **kw)


def test_container_reports_its_address_serves_and_stops_on_request(container, tmp_path, key):
    # Health on a route that needs the key: the container's own checks must send it.
    spec, mailbox, result = spec_for(tmp_path, health_path="/server_info", startup_timeout_s=30), {}, {}
    body = threading.Thread(
        target=lambda: result.update(engines_modal.engine_container_main(spec.to_dict(), 0, mailbox))
    )
    body.start()
    try:
        for _ in range(100):
            if "addr/0" in mailbox:
                break
            body.join(0.1)
        assert mailbox["addr/0"] == f"http://127.0.0.1:{spec.port}"  # the tunnel's url, as given
        assert container == [{"port": spec.port, "unencrypted": False}]  # a TLS tunnel
        assert probe(mailbox["addr/0"] + "/server_info", key=key)[0]
        assert probe(mailbox["addr/0"] + "/server_info") == (False, "HTTP 401")
        assert key not in repr(mailbox)
    finally:
        mailbox["stop"] = True
        body.join(30)
    assert not body.is_alive() and result["index"] == 0
    assert not probe(f"http://127.0.0.1:{spec.port}/health", timeout_s=0.5)[0]  # server ended with it


def test_container_without_the_run_secret_starts_no_server(container, tmp_path, monkeypatch):
    monkeypatch.delenv(ENGINE_BEARER_ENV)
    mailbox: dict = {}
    out = engines_modal.engine_container_main(spec_for(tmp_path).to_dict(), 1, mailbox)
    assert (
        "no engine key in the container" in out["exit"]
        and "Secret is not attached" in mailbox["error/1"]["why"]
    )
    assert container == [] and not list(tmp_path.glob("*.jsonl"))  # no server, no tunnel


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


def test_pool_health_checks_through_the_tunnel_send_the_key(container, tmp_path, key):
    spec = spec_for(tmp_path, count=1, health_path="/server_info")  # a route that needs the key
    mailbox: dict = {}
    body = threading.Thread(target=engines_modal.engine_container_main, args=(spec.to_dict(), 0, mailbox))
    body.start()
    try:
        pool = pool_waiting_on(spec, mailbox, [RunningCall()])
        pool._key = key
        assert pool._wait_all() == [f"http://127.0.0.1:{spec.port}"]
        pool._key = new_run_key()  # a pool with another key does not count this engine as up
        spec2 = EngineSpec.from_dict({**spec.to_dict(), "startup_timeout_s": 0.5})
        pool.spec = spec2
        with pytest.raises(EngineStartError, match="not reachable"):
            pool._wait_all()
    finally:
        mailbox["stop"] = True
        body.join(30)


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


class ContainerCall:
    """A spawned engine function call, run here: ``engine_container_main`` in a thread."""

    def __init__(self, spec_json, index, mailbox, generation=0):
        self.mailbox, self.slot = mailbox, engines_modal.slot(index, generation)
        self.thread = threading.Thread(
            target=engines_modal.engine_container_main, args=(spec_json, index, mailbox, generation)
        )
        self.thread.start()
        self.cancelled = False

    def get(self, timeout=None):
        self.thread.join(timeout or 0)
        if self.thread.is_alive():
            raise TimeoutError
        return {}

    def cancel(self, terminate_containers=False):
        self.cancelled = terminate_containers
        self.mailbox[f"stop/{self.slot}"] = True  # what terminating the container does to it
        self.thread.join(30)


class SpawningFunction:
    def __init__(self):
        self.spawned: list[tuple] = []

    def spawn(self, spec_json, index, mailbox, generation=0):
        self.spawned.append((index, generation))
        return ContainerCall(spec_json, index, mailbox, generation)


def test_replace_cancels_the_old_container_and_spawns_the_same_spec_as_the_next_generation(
    container, tmp_path, key
):
    from modal_rl.engines.health import vllm_generate

    spec = spec_for(tmp_path, count=1, generate=vllm_generate("m"), startup_timeout_s=30)
    mailbox: dict = {}
    fn = SpawningFunction()
    pool = pool_waiting_on(spec, mailbox, [fn.spawn(spec.to_dict(), 0, mailbox)])
    pool._fn, pool._key, pool.generations = fn, key, [0]
    pool.addresses = pool._wait_all()
    first = pool.calls[0]
    assert pool.alive(0) is True
    mailbox["addr/0"] = "http://127.0.0.1:9"  # the dead engine's stale address: never taken again
    url = pool.replace(0)
    try:
        assert first.cancelled and not first.thread.is_alive() and pool.alive(0) is True
        assert fn.spawned == [(0, 0), (0, 1)] and pool.generations == [1]
        assert mailbox["addr/0.1"] == url == pool.addresses[0]
        assert probe(url + "/health", key=key)[0]
        # health through the tunnel was the keyed 1-token generation
        posts = [line for line in (tmp_path / f"{spec.port}.jsonl").read_text().splitlines()]
        assert any('"max_tokens": 1' in line for line in posts)
    finally:
        pool.stop()
    assert mailbox["stop"] is True and pool.calls == []
