"""Loopback is not trusted (issue 50, item 4): another local user (uid ``nobody``, started
from this root test run) squats an engine's port or dials the key forwarder on 127.0.0.1.

- the pool's readiness probe sends the engine bearer only to a listener of our own user: a
  squatter that bound the claimed port first gets no ``Authorization`` header and is not
  returned as an engine;
- the key forwarder closes a loopback connection of another user at accept, allow-list or
  not, and forwards nothing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from modal_rl.cluster import peer_creds
from modal_rl.run_key import RUN_KEY_ENV, new_run_key

NOBODY = 65534
OTHER_PYTHON = "/usr/bin/python3"  # one the other user can run (ours lives under /root)
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(OTHER_PYTHON), reason="needs root to act as another local user"
)

SQUATTER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print("AUTH", self.headers.get("Authorization"), flush=True)
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"{}")
    do_POST = do_GET
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print("PORT", s.server_port, flush=True)
s.serve_forever()
"""


def as_nobody(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [OTHER_PYTHON, "-c", code, *args],
        user=NOBODY,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )


def test_peer_creds_tell_our_listener_from_another_users():
    squatter = as_nobody(SQUATTER)
    try:
        port = int(squatter.stdout.readline().split()[1])
        assert peer_creds.listener_uid("127.0.0.1", port) == NOBODY
        assert not peer_creds.is_ours(peer_creds.listener_uid("127.0.0.1", port))
    finally:
        squatter.kill()
        squatter.wait()


def test_the_readiness_probe_sends_no_bearer_to_a_port_another_user_squatted(monkeypatch, tmp_path):
    from modal_rl.cluster import backend_local
    from modal_rl.engines.pool import EngineSpec, EngineStartError, get_engine_pool

    monkeypatch.setenv(RUN_KEY_ENV, new_run_key())
    squatter = as_nobody(SQUATTER)
    try:
        port = int(squatter.stdout.readline().split()[1])
        # The pool's claim of a port races the other user's bind; here the other user won.
        monkeypatch.setattr(backend_local, "free_ports", lambda n, host: [port] * n)
        slow_engine = (sys.executable, "-c", "import time; time.sleep(60)", "{host}", "{port}")
        spec = EngineSpec(command=slow_engine, name="slow", startup_timeout_s=5.0)
        pool = get_engine_pool(spec, "local", log_dir=str(tmp_path / "logs"))
        try:
            with pytest.raises(EngineStartError, match="held by another user"):
                pool.start()
        finally:
            pool.stop()
    finally:
        squatter.kill()
        out = squatter.communicate()[0]
    assert "AUTH" not in out  # not one request reached it, so no bearer either


DIALER = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
s.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
data = b""
try:
    while chunk := s.recv(4096):
        data += chunk
except OSError:
    pass
print("GOT", len(data), data[:12], flush=True)
"""


def test_the_key_forwarder_closes_another_users_loopback_connection_at_accept():
    from tests.engines.test_key_forwarder import _with

    async def body(up, address, client, fwd, logs):
        port = address.rsplit(":", 1)[1]
        dialer = await asyncio.to_thread(as_nobody, DIALER, port)
        out = (await asyncio.to_thread(dialer.communicate, timeout=20))[0]
        assert out.startswith("GOT 0 "), out  # closed: not one byte of an answer
        assert up.seen == []
        assert any("another user" in line for line in logs)
        async with client.get(address + "/echo") as r:  # our own user, same address
            assert r.status == 200
        assert len(up.seen) == 1

    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(_with(body), 120))
    assert time.monotonic() - t0 < 60


def test_the_readiness_probe_sends_no_bearer_to_our_own_process_that_is_not_the_engine(monkeypatch, tmp_path):
    """A process of our own user (not the engine, nor its child) bound the reserved port first:
    its uid passes, but the listening socket is not the engine's, so no bearer goes to it."""
    from modal_rl.cluster import backend_local
    from modal_rl.engines.pool import EngineSpec, EngineStartError, get_engine_pool

    monkeypatch.setenv(RUN_KEY_ENV, new_run_key())
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUATTER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        port = int(squatter.stdout.readline().split()[1])
        assert peer_creds.is_ours(peer_creds.listener_uid("127.0.0.1", port))
        assert peer_creds.held_by_tree("127.0.0.1", port, squatter.pid) is True
        sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert peer_creds.held_by_tree("127.0.0.1", port, sibling.pid) is False
        finally:
            sibling.kill()
            sibling.wait()
        monkeypatch.setattr(backend_local, "free_ports", lambda n, host: [port] * n)
        slow_engine = (sys.executable, "-c", "import time; time.sleep(60)", "{host}", "{port}")
        spec = EngineSpec(command=slow_engine, name="slow", startup_timeout_s=5.0)
        pool = get_engine_pool(spec, "local", log_dir=str(tmp_path / "logs"))
        try:
            with pytest.raises(EngineStartError, match="not the engine"):
                pool.start()
        finally:
            pool.stop()
    finally:
        squatter.kill()
        out = squatter.communicate()[0]
    assert "AUTH" not in out
