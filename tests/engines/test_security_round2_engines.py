"""Engine output never shows the run key (issue 22, round 2): SGLang logs
``server_args=ServerArgs(..., api_key=..., admin_api_key=...)`` with the key ``keyed_launch``
gave it, so every line we write (local engine logs) or relay (a Modal engine container's output,
its error tail) is redacted, derived keys included, and local logs are 0600 in 0700 folders.
And where ``EnginePusher(expose="modal")``'s frame server listens. Real engine processes
(the stand-ins in tests/), real pipes and files; Modal only as a fake ``modal.forward``."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import stat
import sys
import threading
from pathlib import Path

import psutil
import pytest

from modal_rl.cluster.backend_local import free_ports
from modal_rl.engines import pool_modal as engines_modal
from modal_rl.engines.pool import EngineSpec, EngineStartError
from modal_rl.engines.pool_local import LocalEnginePool
from modal_rl.run_key import RUN_KEY_ENV, derive, engine_bearer, engine_env, frame_read_key, new_run_key

REPO = Path(__file__).resolve().parents[2]
SERVER = str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py"))
SGLANG = [sys.executable, "-m", "modal_rl.engines.keyed_launch", "--key-flag=--api-key"]
SGLANG += ["--key-flag=--admin-api-key", "_sglang_auth_server", "--host", "{host}", "--port", "{port}"]
SGLANG += ["--model-path", "/models/tiny"]


@pytest.fixture
def key(monkeypatch) -> str:
    value = new_run_key()
    monkeypatch.setenv(RUN_KEY_ENV, value)
    # The engines import the SGLang stand-in from tests/.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests")]))
    return value


def leaks(text: str, key: str) -> list[str]:
    """Which of the key and its derived keys (as an engine could print them) are in ``text``."""
    # what an engine derives from what it holds: the record-MAC key, from the frame-read secret
    pull = derive(frame_read_key(key).partition(".")[0], "weightsync-frame-mac")
    forms = [
        key,
        engine_bearer(key),
        frame_read_key(key),
        pull.hex(),
        base64.b64encode(pull).decode().rstrip("="),
    ]
    return [form for form in forms if form in text]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def fake_engine(tmp_path, *extra: str) -> list[str]:
    return [sys.executable, SERVER, "--host", "{host}", "--port", "{port}", "--state", str(tmp_path), *extra]


def test_sglangs_server_args_line_reaches_the_local_log_redacted_and_the_log_is_private(tmp_path, key):
    logs = tmp_path / "logs"  # named by the caller, made by the pool
    pool = LocalEnginePool(EngineSpec(command=SGLANG, startup_timeout_s=60), log_dir=str(logs))
    pool.start()
    try:
        log = pool.log_path(0)
        assert mode(logs) == 0o700 and mode(log) == 0o600
    finally:
        pool.stop()
    text = log.read_text()
    assert "server_args=ServerArgs(model_path='/models/tiny'" in text  # SGLang's line, as it logs it
    assert "api_key='<redacted>', admin_api_key='<redacted>'" in text and leaks(text, key) == []


def test_keys_cut_across_reads_and_derived_keys_never_reach_the_log(tmp_path, key):
    # No log_dir: the logs live in the pool's run temp dir, which must be private too.
    pool = LocalEnginePool(EngineSpec(command=fake_engine(tmp_path, "--log-args", "--require-key")))
    pool.start()
    try:
        log = pool.log_path(0)
        assert log.parent == pool.temp_dir and mode(pool.temp_dir) == 0o700 and mode(log) == 0o600
        pool.replace(0)  # a replacement's log is written the same way
        assert pool.log_path(0) != log and mode(pool.log_path(0)) == 0o600
        texts = [log.read_text(), pool.log_path(0).read_text()]  # stop() removes them
    finally:
        pool.stop()
    for text in texts:
        assert "api_key='<redacted>'" in text and "pull_key=<redacted> b64=<redacted>=" in text
        assert leaks(text, key) == []


def test_a_failed_engines_tail_shows_no_key_nor_derived_key(tmp_path, key):
    spec = EngineSpec(command=fake_engine(tmp_path, "--log-args", "--mode", "crash"))
    with pytest.raises(EngineStartError) as info:
        LocalEnginePool(spec, log_dir=str(tmp_path / "logs")).start()
    assert "exited with code 3" in str(info.value) and "pull_key=<redacted>" in str(info.value)
    assert leaks(str(info.value), key) == []
    (log,) = (tmp_path / "logs").iterdir()
    assert leaks(log.read_text(), key) == [] and mode(log) == 0o600


def test_an_existing_log_file_is_made_private(tmp_path, key):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    old = logs / "engine-0.log"
    old.write_text("an older run's log\n")
    old.chmod(0o644)
    pool = LocalEnginePool(EngineSpec(command=fake_engine(tmp_path), name="engine"), log_dir=str(logs))
    pool.start()
    try:
        assert pool.log_path(0) == old and mode(old) == 0o600
        assert mode(logs) == 0o755  # a folder the caller already had keeps its mode
    finally:
        pool.stop()


class FakeTunnel:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.tls_socket = ("127.0.0.1", port)


@pytest.fixture
def container(monkeypatch, key) -> list:
    """engine_container_main as Modal would run it, on 127.0.0.1 with a local 'tunnel'."""
    import modal

    forwards: list = []

    def forward(port, **kw):
        forwards.append({"port": port, **kw})
        return contextlib.nullcontext(FakeTunnel(port))

    # What a Modal engine container holds (its Secret is ``engine_env``): never the run key.
    monkeypatch.delenv(RUN_KEY_ENV)
    for name, value in engine_env(key).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(engines_modal, "CONTAINER_HOST", "127.0.0.1")
    monkeypatch.setattr(engines_modal, "CONTAINER_POLL_S", 0.1)
    monkeypatch.setattr(modal, "forward", forward)
    return forwards


def test_a_modal_engines_output_is_relayed_to_modals_logs_redacted(container, tmp_path, key, capfd):
    (port,) = free_ports(1, "127.0.0.1")
    spec = EngineSpec(command=SGLANG, port=port, startup_timeout_s=60)
    mailbox: dict = {}
    body = threading.Thread(target=engines_modal.engine_container_main, args=(spec.to_dict(), 0, mailbox))
    body.start()
    try:
        for _ in range(600):
            if "addr/0" in mailbox or not body.is_alive():
                break
            body.join(0.1)
        assert "addr/0" in mailbox, mailbox
    finally:
        mailbox["stop"] = True
        body.join(60)
    out = capfd.readouterr().out
    assert "server_args=ServerArgs(model_path='/models/tiny'" in out
    assert "api_key='<redacted>', admin_api_key='<redacted>'" in out and leaks(out, key) == []


def test_a_modal_engines_error_tail_and_relayed_pieces_show_no_key(container, tmp_path, key, capfd):
    (port,) = free_ports(1, "127.0.0.1")
    spec = EngineSpec(command=fake_engine(tmp_path, "--log-args", "--mode", "crash"), port=port)
    mailbox: dict = {}
    out = engines_modal.engine_container_main(spec.to_dict(), 2, mailbox)
    assert out["exit"] == "exited with code 3"
    tail = "\n".join(mailbox["error/2"]["tail"])
    assert "pull_key=<redacted>" in tail and leaks(tail, key) == []
    relayed = capfd.readouterr().out  # written in 7-character pieces: keys cut across reads
    assert "pull_key=<redacted>" in relayed and leaks(relayed, key) == []


def test_engine_pushers_tunnel_side_frame_server_is_ipv4_only_and_keyed(monkeypatch):
    """Modal's ingress needs more than loopback: the default route's IPv4 address (round 3:
    that one interface, no longer the 0.0.0.0 wildcard), so i6pn's IPv6 peers and other
    interfaces do not reach it; whoever reaches it meets the handshake."""
    import modal

    from modal_rl.cluster.netif import ingress_ipv4
    from modal_rl.engines.vllm_push import EnginePusher
    from tests.weightsync_helpers import TEST_KEY

    forwarded: list = []

    @contextlib.contextmanager
    def forward(port, **kw):
        forwarded.append((port, kw))
        yield FakeTunnel(port)

    monkeypatch.setattr(modal, "forward", forward)
    with EnginePusher(None, key=TEST_KEY, expose="modal") as pusher:
        port = pusher._server.address[1]
        assert forwarded == [(port, {})]  # TLS: no unencrypted=True
        listening = [
            c
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert [(c.family, c.laddr.ip) for c in listening] == [(socket.AF_INET, ingress_ipv4())]
        assert ingress_ipv4() != "0.0.0.0"
        with pytest.raises(ConnectionRefusedError):  # not on loopback: one interface only
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        with socket.create_connection((ingress_ipv4(), port), timeout=10) as stranger:
            stranger.sendall(b'{"have": null}\n')  # no key
            answer = stranger.makefile("rb").read()
        assert b"MRLW" not in answer and "error" in json.loads(answer)
