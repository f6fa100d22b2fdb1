"""Round 3 (issue 35), item 3: connection admission on the frame server (slowloris).

Hundreds of silent sockets — from one peer, and from many loopback addresses — are opened
against a real frame server; the server holds at most its caps of them, closes the rest
(stalled ones first), and a receiver with the key still connects and gets its weights.
"""

from __future__ import annotations

import socket
import time

import psutil
import pytest

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.tcp import (
    HANDSHAKE_TIMEOUT_S,
    MAX_UNAUTHENTICATED,
    MAX_UNAUTHENTICATED_PER_PEER,
    FrameServer,
    TcpSource,
)
from tests.weightsync_helpers import TEST_KEY, model_state, same_state

CONFIG = CodecConfig(chunk_elems=4096, threads=2)
BASE = model_state()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    srv = FrameServer()
    Publisher(srv, config=CONFIG).publish(BASE)
    yield srv
    srv.close()


def _silent(address, count: int, sources: list[str]) -> list[socket.socket]:
    socks = []
    for i in range(count):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        s.connect(address)
        socks.append(s)
    return socks


def _held_by_server(port: int) -> int:
    """Established connections on the server's side of ``port`` (in this process)."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def _receive(server) -> dict:
    live: dict = {}
    sub = Subscriber(TcpSource(*server.address, key=TEST_KEY), copy_into(live), CONFIG)
    try:
        sub.stage_until(0, timeout_s=10, max_refusals=0)
    finally:
        sub.source.close()
    return live


@pytest.mark.parametrize("peers", [1, 50], ids=["one peer", "fifty peers"])
def test_a_receiver_with_the_key_gets_in_while_hundreds_of_silent_sockets_are_open(server, peers):
    sources = [f"127.0.0.{i + 1}" for i in range(peers)]
    socks = _silent(server.address, 300, sources)
    try:
        time.sleep(0.5)  # the server has accepted them all by now
        cap = MAX_UNAUTHENTICATED_PER_PEER if peers == 1 else MAX_UNAUTHENTICATED
        assert len(server.unauthenticated) <= cap
        assert _held_by_server(server.address[1]) <= cap  # the rest are closed: no fd pile-up
        assert server.unauthenticated.evicted >= 300 - cap
        t0 = time.monotonic()
        live = _receive(server)
        assert same_state(live, BASE) and time.monotonic() - t0 < 5
    finally:
        for s in socks:
            s.close()


def test_a_silent_socket_is_closed_after_the_hello_deadline(server):
    (sock,) = _silent(server.address, 1, ["127.0.0.1"])
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S + 5)
        t0 = time.monotonic()
        assert sock.recv(1) == b""  # closed by the server, nothing sent
        assert time.monotonic() - t0 <= HANDSHAKE_TIMEOUT_S + 1
        assert not server.unauthenticated
    finally:
        sock.close()
