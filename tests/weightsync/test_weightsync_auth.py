"""The trust boundary of weight sync: signed records, the frame server's mutual handshake,
TLS to a tunnel's end, stores that refuse tampered files. Real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from modal_rl.run_key import RUN_KEY_ENV, MissingRunKeyError
from modal_rl.weightsync import CodecConfig, VersionChain, encode_anchor, encode_delta, frame_bytes
from modal_rl.weightsync.errors import (
    RecordMacError,
    SignedFrameError,
    UnsignedFrameError,
    VersionNotReachedError,
)
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.store import DirectoryStore
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from modal_rl.weightsync.wire.auth import HANDSHAKE, frame_keys, hello_line, sign_records
from tests.weightsync_helpers import (
    OTHER_KEY,
    TEST_KEY,
    TlsTerminator,
    clone_state,
    model_state,
    perturb,
    records,
    reseal,
    same_state,
    self_signed_cert,
)

CONFIG = CodecConfig(chunk_elems=4096, threads=2)
BASE = model_state()
NEW = perturb(BASE, 0.05, seed=1)


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def signed(records_, key=TEST_KEY) -> bytes:
    return frame_bytes(sign_records(records_, frame_keys(key)))


def anchor(key=TEST_KEY, state=BASE) -> bytes:
    return signed(encode_anchor(state, version=0, config=CONFIG), key)


def delta(key=TEST_KEY, new=NEW) -> bytes:
    return signed(encode_delta(BASE, new, base_version=0, version=1, config=CONFIG), key)


def body_of(frame: bytes, rec) -> bytes:
    offset, size, _ = rec
    return frame[offset + 5 : offset + size - 40]


def held_chain() -> tuple[VersionChain, dict]:
    chain = VersionChain(CONFIG)
    chain.apply(anchor())
    return chain, clone_state(chain.state)


def test_a_byte_flipped_with_its_checksum_recomputed_is_refused_and_changes_nothing():
    chain, before = held_chain()
    frame = delta()
    for rec in records(frame):  # every record kind: the header, groups, chunks, the end
        body = bytearray(body_of(frame, rec))
        body[len(body) // 2] ^= 0x01
        with pytest.raises(RecordMacError, match="fails its MAC"):
            chain.apply(reseal(frame, rec[0], bytes(body)))
        assert chain.version == 0 and same_state(chain.state, before)
    chain.apply(frame)  # the intact frame still applies
    assert same_state(chain.state, NEW)


def test_records_cannot_be_spliced_moved_or_dropped():
    chain, before = held_chain()
    frame = delta()
    other = delta(new=perturb(BASE, 0.05, seed=2))  # same version and layout, other contents
    recs, others = records(frame), records(other)
    chunks = [i for i, r in enumerate(recs) if r[2] == b"C"]
    assert len(chunks) >= 2 and [r[2] for r in recs] == [r[2] for r in others]

    def cut(f, r):
        return f[r[0] : r[0] + r[1]]

    i, j = chunks[0], chunks[1]
    spliced = b"".join(cut(other, others[k]) if k == i else cut(frame, r) for k, r in enumerate(recs))
    swapped = b"".join(cut(frame, recs[{i: j, j: i}.get(k, k)]) for k in range(len(recs)))
    dropped = b"".join(cut(frame, r) for k, r in enumerate(recs) if k != i)
    for forged in (spliced, swapped, dropped):
        with pytest.raises(RecordMacError):
            chain.apply(forged)
        assert chain.version == 0 and same_state(chain.state, before)


def test_the_signing_mode_and_the_key_must_match():
    with pytest.raises(UnsignedFrameError, match="not signed"):
        VersionChain(CONFIG).apply(frame_bytes(encode_anchor(BASE, version=0, config=CONFIG)))
    with pytest.raises(SignedFrameError, match="keyless"):
        VersionChain(CONFIG, key=None).apply(anchor())
    with pytest.raises(RecordMacError):
        VersionChain(CONFIG, key=OTHER_KEY).apply(anchor())
    keyless = VersionChain(CONFIG, key=None)  # today's v1 frames, when asked for explicitly
    keyless.apply(frame_bytes(encode_anchor(BASE, version=0, config=CONFIG)))
    assert same_state(keyless.state, BASE)


def test_an_omitted_key_is_the_run_key_and_its_absence_says_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.delenv(RUN_KEY_ENV)
    for make in (
        FrameServer,
        lambda: TcpSource("127.0.0.1", 9),
        lambda: DirectoryStore(tmp_path),
        VersionChain,
    ):
        with pytest.raises(MissingRunKeyError, match=RUN_KEY_ENV):
            make()
    assert repr(frame_keys(TEST_KEY)) == "FrameKeys(<redacted>)"


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


def test_the_frame_server_sends_no_frame_byte_to_a_receiver_without_the_key(caplog):
    server = FrameServer(keep_anchors=1)
    Publisher(server, config=CONFIG).publish(BASE)  # a retained anchor it could send
    caplog.set_level(logging.INFO, logger="modal_rl.weightsync.transport.tcp")
    try:
        with socket.create_connection(server.address) as keyless:
            keyless.sendall(b'{"have": null}\n')  # today's (v1) hello: no key
            got = _read_all(keyless)
        assert json.loads(got) == {"error": json.loads(got)["error"]} and got.count(b"\n") == 1
        with socket.create_connection(server.address) as guesser:
            line, _ = hello_line(None, frame_keys(OTHER_KEY))
            guesser.sendall(line)
            answer = json.loads(guesser.makefile("rb").readline())
            assert answer["auth"] == HANDSHAKE and len(answer["proof"]) == 64
            guesser.sendall(json.dumps({"proof": "0" * 64}).encode() + b"\n")  # cannot prove the key
            got = _read_all(guesser)
        assert b"does not know this run's key" in got and b"MRLW" not in got and got.count(b"\n") == 1
        assert server.receivers == 0 and not server.pending
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 2 and all(r.exc_info is None for r in refusals)
        assert all(TEST_KEY not in r.getMessage() for r in caplog.records)
    finally:
        server.close()


def test_a_frame_server_with_another_key_cannot_feed_a_receiver():
    rogue = FrameServer(key=OTHER_KEY)
    Publisher(rogue, config=CONFIG).publish(NEW)
    raw = socket.create_server(("127.0.0.1", 0))  # skips the handshake, sends signed records
    live: dict = {}
    try:
        for address in (rogue.address, raw.getsockname()[:2]):
            sub = Subscriber(TcpSource(*address), copy_into(live), CONFIG)
            if address != rogue.address:
                import threading

                def serve():
                    conn, _ = raw.accept()
                    conn.recv(4096)
                    conn.sendall(anchor(OTHER_KEY, NEW))

                threading.Thread(target=serve, daemon=True).start()
            with pytest.raises(VersionNotReachedError, match="HandshakeError"):
                sub.stage_until(0, timeout_s=5, max_refusals=0)
            assert sub.chain.version is None and live == {} and sub.timings == []
            sub.source.close()
        assert rogue.receivers == 0
    finally:
        rogue.close()
        raw.close()


def test_a_store_refuses_a_tampered_file_and_an_unsigned_one(tmp_path):
    publisher = Publisher(DirectoryStore(tmp_path), anchor_every=10, config=CONFIG)
    publisher.publish(BASE)
    live: dict = {}
    sub = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    assert sub.run_until(0, timeout=10)
    publisher.publish(NEW)
    path = next((tmp_path / "frames").glob("*.delta"))
    frame = path.read_bytes()
    rec = next(r for r in records(frame) if r[2] == b"C")
    body = bytearray(body_of(frame, rec))
    body[0] ^= 0x80
    path.write_bytes(reseal(frame, rec[0], bytes(body)))
    assert not sub.run_until(1, timeout=1)
    assert sub.refused and all("RecordMacError" in r for r in sub.refused)
    assert sub.chain.version == 0 and same_state(live, BASE)
    path.write_bytes(frame)  # the intact file is accepted
    assert sub.run_until(1, timeout=10) and same_state(live, NEW)

    plain = tmp_path / "plain"
    Publisher(DirectoryStore(plain, key=None), config=CONFIG).publish(BASE)
    keyed = Subscriber(DirectoryStore(plain), copy_into({}), CONFIG)
    assert not keyed.run_until(0, timeout=0.5) and "UnsignedFrameError" in keyed.refused[0]
    keyless = Subscriber(DirectoryStore(plain, key=None), copy_into({}), CONFIG)
    assert keyless.run_until(0, timeout=10)


def test_tls_to_a_tunnel_end_carries_frames_and_checks_the_certificate(tmp_path):
    certfile, keyfile = self_signed_cert(tmp_path)
    server = FrameServer()
    terminator = TlsTerminator(server.address, certfile, keyfile)
    publisher = Publisher(server, anchor_every=10, config=CONFIG)
    live: dict = {}
    trusting = Subscriber(TcpSource(*terminator.address, tls=True, cafile=certfile), copy_into(live), CONFIG)
    untrusting = Subscriber(TcpSource(*terminator.address, tls=True), copy_into({}), CONFIG)
    try:
        for version, state in enumerate((BASE, NEW)):
            publisher.publish(state)
            assert trusting.run_until(version, timeout=30)
            assert same_state(live, state)
        with pytest.raises(VersionNotReachedError, match="certificate"):
            untrusting.stage_until(0, timeout_s=5, max_refusals=0)
        assert untrusting.chain.version is None
    finally:
        trusting.source.close()
        untrusting.source.close()
        terminator.close()
        server.close()
