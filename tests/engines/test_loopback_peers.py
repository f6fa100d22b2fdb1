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


# Another user who watches for the pool's claim of a port (its name is public in
# /proc/net/unix) and binds the port the moment it appears, with every reuse flag set.
CLAIM_SQUATTER = r"""
import http.server, socket, sys, time
port = int(sys.argv[1])
name = "@modal-rl-port-%d" % port
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not any(l.rstrip().endswith(name) for l in open("/proc/net/unix")):
    time.sleep(0.002)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print("AUTH", self.headers.get("Authorization"), flush=True)
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", port), H, bind_and_activate=False)
s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
try:
    s.server_bind(); s.server_activate()
except OSError as exc:
    print("REFUSED", exc.errno, flush=True); sys.exit()
print("SQUATTED", flush=True)
s.serve_forever()
"""

# A slow engine: it binds its port 1.5 s after it starts, with SO_REUSEPORT (argv[3] == "1").
SLOW_ENGINE = r"""
import http.server, socket, sys, time
time.sleep(1.5)
class S(http.server.ThreadingHTTPServer):
    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(sys.argv[3]))
        super().server_bind()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
S((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""


def _one_port_range(monkeypatch) -> int:
    """A free port, unclaimed again, as the only one ``ports.reserve`` may pick (so the
    squatter below watches this one claim and no other process's)."""
    from modal_rl.cluster import ports

    (port,) = ports.reserve(1)
    name = ports._CLAIM_PREFIX + str(port).encode()
    for entry in [c for c in ports._claims if c[1].getsockname() == name]:
        ports._claims.remove(entry)
        entry[1].close()
    monkeypatch.setattr(ports, "port_range", lambda: range(port, port + 1))
    return port


@pytest.mark.parametrize("shares_port", [True, False], ids=["held", "not-held"])
def test_a_reserved_port_stays_ours_until_the_engine_listens_on_it(monkeypatch, tmp_path, shares_port):
    """The other user binds the port as soon as the pool claims it. Held (a server that binds
    with SO_REUSEPORT): the kernel refuses the squatter, the engine starts on that port and
    ``start()`` returns it. Not held: the squatter gets the port, and the start stops before
    any bearer is sent (the squatter does win the race, so the held case can fail)."""
    from modal_rl.engines.pool import EngineSpec, EngineStartError, get_engine_pool

    monkeypatch.setenv(RUN_KEY_ENV, new_run_key())
    port = _one_port_range(monkeypatch)
    squatter = as_nobody(CLAIM_SQUATTER, str(port))
    try:
        engine = (sys.executable, "-c", SLOW_ENGINE, "{host}", "{port}", str(int(shares_port)))
        spec = EngineSpec(command=engine, name="slow", startup_timeout_s=30.0, shares_port=shares_port)
        pool = get_engine_pool(spec, "local", log_dir=str(tmp_path / "logs"))
        try:
            if shares_port:
                assert pool.start() == [f"http://127.0.0.1:{port}"]
                assert peer_creds.held_by_tree("127.0.0.1", port, pool.pid(0)) is True
                assert pool._holds == {}  # handed over: the engine holds the port alone
            else:
                with pytest.raises(EngineStartError, match="held by another user"):
                    pool.start()
        finally:
            pool.stop()
    finally:
        squatter.kill()
        out = squatter.communicate()[0]
    assert ("REFUSED" if shares_port else "SQUATTED") in out, out
    assert "AUTH" not in out
