"""Frames applied as they arrive (``TcpSource.next_records`` → ``VersionChain.apply_records``):
chunks are decoded while later records are on the wire, and a frame cut off on the way
leaves the held weights as they were and is asked for again, without counting a refusal."""

from __future__ import annotations

import io
import json
import socket
import threading
import time

import pytest

from modal_rl.weightsync import CodecConfig, VersionChain, encode_anchor, encode_delta
from modal_rl.weightsync.chain import frame_bytes
from modal_rl.weightsync.errors import FrameInterruptedError, StaleVersionError
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.tcp_source import Dial, TcpSource
from modal_rl.weightsync.wire.frames import split_records
from tests.weightsync_helpers import clone_state, model_state, perturb, same_state

CONFIG = CodecConfig(chunk_elems=4096, threads=2)
BASE = model_state()
NEW = perturb(BASE, 0.05, seed=1)
NEWER = perturb(NEW, 0.05, seed=2)
ANCHOR = frame_bytes(encode_anchor(BASE, version=0, config=CONFIG))
DELTA = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=CONFIG))
ANCHOR2 = frame_bytes(encode_anchor(NEWER, version=2, config=CONFIG))


def raw_records(frame: bytes) -> list[tuple[bytes, bytes]]:
    return list(split_records(io.BytesIO(frame)))


def held_at_base() -> VersionChain:
    chain = VersionChain(CONFIG, key=None, retain=False)
    chain.apply(ANCHOR)
    return chain


def test_chunks_are_written_before_the_end_record_arrives():
    chain = held_at_base()
    seen_before_end = []

    def arriving():
        records = raw_records(DELTA)
        yield from records[:-1]
        # every chunk is on the "wire"; the end record is not: the delta is already applied
        deadline = time.monotonic() + 30
        while not same_state(chain.state, NEW) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen_before_end.append(same_state(chain.state, NEW))
        yield records[-1]

    result = chain.apply_records(arriving())
    assert seen_before_end == [True]
    assert chain.version == 1 and result.header.version == 1
    assert same_state(chain.state, NEW)


@pytest.mark.parametrize("cut", [2, 5, -1])
def test_a_frame_cut_off_on_the_way_leaves_the_held_state_unchanged(cut):
    chain = held_at_base()

    def arriving():
        yield from raw_records(DELTA)[:cut]
        raise FrameInterruptedError("test: the connection dropped")

    with pytest.raises(FrameInterruptedError):
        chain.apply_records(arriving())
    assert chain.version == 0
    assert same_state(chain.state, BASE)


def test_order_is_checked_before_anything_is_decoded():
    chain = held_at_base()
    chain.apply_records(iter(raw_records(DELTA)))
    before = clone_state(chain.state)
    with pytest.raises(StaleVersionError):  # a replay of version 1: refused by its header
        chain.apply_records(iter(raw_records(DELTA)))
    assert chain.version == 1 and same_state(chain.state, before)


def test_a_chain_that_retains_frames_takes_them_whole():
    with pytest.raises(ValueError, match="whole"):
        VersionChain(CONFIG, key=None, retain=True).apply_records(iter(raw_records(ANCHOR)))


class ScriptedServer:
    """A keyless frame server on a loopback socket that plays one script per connection
    (the bytes to send, then whether to hang up), and records each receiver's hello."""

    def __init__(self, scripts: list[tuple[bytes, bool]]):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.scripts = scripts
        self.hellos: list[dict] = []
        self.open: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        for payload, hang_up in self.scripts:
            conn, _ = self.listener.accept()
            line = b""
            while not line.endswith(b"\n"):
                line += conn.recv(1)
            self.hellos.append(json.loads(line))
            conn.sendall(payload)
            if hang_up:
                conn.close()
            else:
                self.open.append(conn)

    def close(self) -> None:
        for conn in self.open:
            conn.close()
        self.listener.close()


def prefix(frame: bytes, records: int) -> bytes:
    return b"".join(raw for _, raw in raw_records(frame)[:records])


def test_a_dropped_connection_mid_frame_is_asked_again_and_not_refused():
    server = ScriptedServer([(ANCHOR + prefix(DELTA, 4), True), (DELTA, False)])
    live: dict = {}
    seen: list[bytes] = []
    source = TcpSource(
        "127.0.0.1", server.port, key=None, dial=Dial(backoff_s=0.01), on_record=lambda t, r: seen.append(r)
    )
    subscriber = Subscriber(source, copy_into(live), CONFIG)
    try:
        assert subscriber.poll(30).version == 0
        assert subscriber.poll(30) is None  # cut off: rolled back, not activated
        assert subscriber.refused == [] and subscriber.chain.version == 0
        assert same_state(subscriber.chain.state, BASE) and same_state(live, BASE)
        timing = subscriber.poll(30)
        assert timing.version == 1 and timing.bytes == len(DELTA)
        assert same_state(live, NEW)
        assert [h["have"] for h in server.hellos] == [None, 0]  # it asked for what it lacked
        assert len(seen) == len(raw_records(ANCHOR)) + 4 + len(raw_records(DELTA))
    finally:
        source.close()
        server.close()


def test_a_new_frame_begun_mid_frame_is_taken_whole_and_seen_once():
    """The publisher gave a delta up half way (its send failed) and began an anchor: the
    receiver rolls the delta back and activates the anchor; a relay sees each record once."""
    server = ScriptedServer([(ANCHOR + prefix(DELTA, 4) + ANCHOR2, False)])
    live: dict = {}
    seen: list[bytes] = []
    source = TcpSource("127.0.0.1", server.port, key=None, on_record=lambda t, r: seen.append(r))
    subscriber = Subscriber(source, copy_into(live), CONFIG)
    try:
        assert subscriber.poll(30).version == 0
        assert subscriber.poll(30) is None
        assert same_state(subscriber.chain.state, BASE)
        assert subscriber.poll(30).version == 2
        assert same_state(live, NEWER) and subscriber.refused == []
        assert b"".join(seen) == ANCHOR + prefix(DELTA, 4) + ANCHOR2
        assert len(server.hellos) == 1  # no reconnect
    finally:
        source.close()
        server.close()
