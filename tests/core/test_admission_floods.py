"""Admission before reading (issue 50, item 5), with real sockets on 127.0.0.1.

A flooder keeps 400 keyless connections open against a server, re-opening every one the
server closes, from the *same* loopback address as the keyed client (so a per-address cap
alone cannot tell them apart): silent sockets, and half-sent lines. While it runs, a client
that holds the key must still get in, every time, within a few seconds.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from tests.weightsync_helpers import TEST_KEY, model_state, same_state

CONFIG = CodecConfig(chunk_elems=4096, threads=2)
BASE = model_state()
FLOOD = 400
PAYLOADS = {
    "silent": b"",
    "half-sent": b'{"have": null, "auth": "',
    # a whole keyless hello (anyone can write one), then idle: no proof ever follows
    "idle-after-hello": b'{"have": null, "auth": "hmac-sha256-v1", "nonce": "' + b"ab" * 32 + b'"}\n',
}


class Flooder:
    """``count`` connections to ``address`` held open, each closed one re-opened at once."""

    def __init__(self, address, payload: bytes, source: str = "127.0.0.1", count: int = FLOOD) -> None:
        self.address, self.payload, self.source, self.count = address, payload, source, count
        self.stop = threading.Event()
        self.opened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while self.opened < self.count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(20)

    def _open(self) -> socket.socket | None:
        s = socket.socket()
        try:
            s.bind((self.source, 0))
            s.settimeout(2)
            s.connect(self.address)
            if self.payload:
                s.sendall(self.payload)
            s.setblocking(False)
            self.opened += 1
            return s
        except OSError:
            s.close()
            return None

    def _run(self) -> None:
        socks = [s for s in (self._open() for _ in range(self.count)) if s]
        while not self.stop.is_set():
            alive = []
            for s in socks:
                try:
                    if s.recv(1 << 12) == b"":  # closed by the server: open another
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                alive.append(s)
            alive += [s for s in (self._open() for _ in range(self.count - len(alive))) if s]
            socks = alive
            time.sleep(0.01)
        for s in socks:
            s.close()


@pytest.fixture
def frame_server(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    srv = FrameServer()
    Publisher(srv, config=CONFIG).publish(BASE)
    yield srv
    srv.close()


def _receive(server) -> dict:
    live: dict = {}
    sub = Subscriber(TcpSource(*server.address, key=TEST_KEY), copy_into(live), CONFIG)
    try:
        sub.stage_until(0, timeout_s=10, max_refusals=0)
    finally:
        sub.source.close()
    return live


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_a_keyed_receiver_gets_in_through_a_same_address_flood_at_a_frame_server(frame_server, kind):
    # The bar scales with what an unflooded receive costs on this host right now: a starved
    # receiver waits out its 10 s stage timeout, a loaded host only slows both alike.
    t0 = time.monotonic()
    assert same_state(_receive(frame_server), BASE)
    bar = 5 + 4 * (time.monotonic() - t0)
    with Flooder(frame_server.address, PAYLOADS[kind]) as flood:
        assert flood.opened >= FLOOD
        for _ in range(5):
            t0 = time.monotonic()
            assert same_state(_receive(frame_server), BASE)
            assert time.monotonic() - t0 < bar
        assert len(frame_server.unauthenticated) <= 64


async def _comes_to_none(port: int, source: str, within_s: float) -> bool:
    """True once no connection from ``source`` is held, polled until ``within_s``."""
    deadline = asyncio.get_running_loop().time() + within_s
    while _held_from(port, source):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _held_from(port: int, source: str) -> int:
    """Established connections to ``port`` that this process holds, from ``source``."""
    import psutil

    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.laddr
        and c.laddr.port == port
        and c.raddr
        and c.raddr.ip == source
        and c.status == psutil.CONN_ESTABLISHED
    )


def test_a_keyless_flood_holds_few_sockets_at_the_control_channel_and_a_follower_gets_in():
    import asyncio

    from modal_rl.cluster.control import ControlClient, ControlServer
    from modal_rl.cluster.ports import reserve

    async def scenario():
        (port,) = reserve(1, "127.0.0.2")
        server = ControlServer(nodes=2, lost_after_s=30, key="run-key-A")
        await server.start("127.0.0.2", port)
        flood = Flooder(("127.0.0.2", port), b"", source="127.0.0.3")
        await asyncio.to_thread(flood.__enter__)
        try:
            await asyncio.sleep(0.5)
            # control.MAX_UNPROVEN_PER_PEER; a snapshot can catch one socket accepted and not
            # yet evicted (a burst of them under load), so the cap bounds the typical count
            held = []
            for _ in range(20):
                held.append(_held_from(port, "127.0.0.3"))
                await asyncio.sleep(0.01)
            assert sorted(held)[len(held) // 2] <= 8, held  # the median: the cap in steady state
            client = await asyncio.to_thread(ControlClient, "127.0.0.2", port, 1, 5.0, 0.1, "run-key-A")
            end = asyncio.get_running_loop().time() + 5
            while server.followers[1].connected_at is None:
                assert asyncio.get_running_loop().time() < end, "the keyed follower was kept out"
                await asyncio.sleep(0.02)
            client.close()
        finally:
            await asyncio.to_thread(flood.__exit__, None, None, None)
            await server.release(0)

    asyncio.run(scenario())


def test_a_flood_from_outside_the_key_forwarders_allow_list_is_closed_at_accept(monkeypatch):
    import asyncio

    import aiohttp

    from modal_rl.engines import key_forwarder
    from tests.engines.test_key_forwarder import _with

    monkeypatch.setattr(key_forwarder, "HEADER_DEADLINE_S", 1.0, raising=False)
    half = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: "

    async def body(up, address, client, fwd, logs):
        port = int(address.rsplit(":", 1)[1])
        outside = Flooder(("127.0.0.1", port), half, source="127.0.0.3")
        await asyncio.to_thread(outside.__enter__)
        try:
            await asyncio.sleep(0.5)
            # none read, none held: the flooder reconnects at once, so a snapshot can catch a
            # socket between its accept and its close; the server must come back to none
            assert await _comes_to_none(port, "127.0.0.3", within_s=3.0)
            conn = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=conn, trust_env=False) as allowed:
                for _ in range(5):
                    async with allowed.get(address + "/echo") as r:
                        assert r.status == 200
        finally:
            await asyncio.to_thread(outside.__exit__, None, None, None)
        # An allowed peer's half-sent requests (fewer than its cap) end at the header deadline.
        slow = Flooder(("127.0.0.1", port), half, source="127.0.0.2", count=20)
        await asyncio.to_thread(slow.__enter__)
        try:
            await asyncio.sleep(0.3)
            opened = slow.opened
            # all 20 opened (more once a slow host's sleep outlasts the 1 s deadline: reopened)
            assert opened >= 20
            await asyncio.sleep(2.5)
            assert slow.opened > opened  # the server closed them (the flooder re-opened)
        finally:
            await asyncio.to_thread(slow.__exit__, None, None, None)

    asyncio.run(asyncio.wait_for(_with(body, allow_peers=["127.0.0.2"]), 120))


@pytest.mark.parametrize("stage", ["line-waiting", "answered"])
def test_a_flood_from_the_keyed_clients_own_address_evicts_its_own_stalled_sockets(stage):
    """The policy itself, deterministic: a keyed client whose whole line is waiting (or whose
    line the server already answered) is the oldest slot of 127.0.0.1 when 8 silent sockets of
    the same address arrive; a stalled one is evicted, not the keyed client."""
    import asyncio

    from modal_rl.admission import Admission

    async def scenario():
        admission = Admission(total=64, per_peer=8)
        slots = []

        async def handle(reader, writer):
            slots.append(admission.hold(writer, reader))
            if stage == "answered" and len(slots) == 1:
                await reader.readline()  # the server reads the hello and answers it
                admission.progressed(writer)
            await asyncio.sleep(30)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        keyed = await asyncio.open_connection("127.0.0.1", port)
        keyed[1].write(b'{"have": null}\n')
        await asyncio.sleep(0.2)
        flood = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
        await asyncio.sleep(0.2)
        try:
            assert len(slots) == 9 and not slots[0].evicted
            assert sum(s.evicted for s in slots[1:]) == 1 and len(admission) == 8
        finally:
            for _, w in [keyed, *flood]:
                w.close()
            server.close()

    asyncio.run(scenario())
