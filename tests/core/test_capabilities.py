"""Round 3 (issue 35), item 1: each part holds only the key it needs.

An engine holds its bearer and the frame-read key, never the run key. The tests try what a
leaked engine bearer could do: pass the frame server's handshake (read weights), sign a frame a
receiver accepts, act as Ray's token. And what a leaked frame-read key could do: sign a lease.
Real sockets, a real frame server and real receivers.
"""

from __future__ import annotations

import pytest

from modal_rl.cluster.redaction import Redactor
from modal_rl.run_key import (
    ENGINE_BEARER_ENV,
    FRAME_READ_ENV,
    RAY_TOKEN_ENV,
    RUN_KEY_ENV,
    derive,
    engine_bearer,
    engine_env,
    frame_read_key,
    key_env,
    ray_token,
    redact,
)
from modal_rl.weightsync import CodecConfig, VersionChain, encode_anchor, frame_bytes
from modal_rl.weightsync.errors import RecordMacError, VersionNotReachedError
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from modal_rl.weightsync.wire.auth import (
    FROM_ENV,
    FrameKeys,
    frame_keys,
    sign_json,
    sign_records,
    verify_json,
)
from tests.weightsync_helpers import TEST_KEY, model_state, same_state

CONFIG = CodecConfig(chunk_elems=4096, threads=2)
BASE = model_state()
BEARER = engine_bearer(TEST_KEY)
PUBLIC = frame_read_key(TEST_KEY).partition(".")[2]  # the trainer's public key: no secret


def _as(what: str, text: str) -> FrameKeys:
    """Keys made from ``text`` as the run key, or as a frame-read secret beside the public key."""
    return FrameKeys(text) if what == "run key" else FrameKeys.reading(f"{text}.{PUBLIC}")


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


@pytest.fixture
def server():
    srv = FrameServer(key=TEST_KEY, keep_anchors=1)
    Publisher(srv, config=CONFIG).publish(BASE)
    yield srv
    srv.close()


def _pull(server, keys) -> dict:
    live: dict = {}
    sub = Subscriber(TcpSource(*server.address, key=keys), copy_into(live), CONFIG)
    try:
        sub.stage_until(0, timeout_s=10, max_refusals=0)
    finally:
        sub.source.close()
    return live


@pytest.mark.parametrize("as_what", ["run key", "frame-read key"])
def test_a_leaked_engine_bearer_reads_no_weight(server, as_what):
    keys = _as(as_what, BEARER)
    with pytest.raises(VersionNotReachedError, match="HandshakeError"):
        _pull(server, keys)
    assert server.receivers == 0


def test_the_frame_read_key_an_engine_holds_reads_weights(server):
    live = _pull(server, FrameKeys.reading(frame_read_key(TEST_KEY)))
    assert same_state(live, BASE)


@pytest.mark.parametrize("as_what", ["run key", "frame-read key"])
def test_a_leaked_engine_bearer_signs_no_frame_a_receiver_accepts(as_what):
    if as_what == "run key":
        forged = frame_bytes(
            sign_records(encode_anchor(BASE, version=0, config=CONFIG), _as(as_what, BEARER))
        )
    else:  # a reader signs no frame at all
        with pytest.raises(PermissionError, match="frame-read key only"):
            frame_bytes(sign_records(encode_anchor(BASE, version=0, config=CONFIG), _as(as_what, BEARER)))
        return
    chain = VersionChain(CONFIG, key=TEST_KEY)
    with pytest.raises(RecordMacError):
        chain.apply(forged)
    assert chain.version is None


def test_a_leaked_engine_bearer_is_not_the_ray_token_nor_any_other_key():
    assert BEARER != TEST_KEY and BEARER != ray_token(TEST_KEY) != TEST_KEY
    assert key_env(TEST_KEY)[RAY_TOKEN_ENV] == ray_token(TEST_KEY)
    assert frame_read_key(TEST_KEY) != BEARER
    # An engine's environment: its bearer and the frame-read key, nothing Ray or the trainer holds.
    env = engine_env(TEST_KEY)
    assert set(env) == {ENGINE_BEARER_ENV, FRAME_READ_ENV}
    assert TEST_KEY not in env.values() and ray_token(TEST_KEY) not in env.values()


def test_a_frame_read_key_cannot_sign_a_lease():
    reader = FrameKeys.reading(frame_read_key(TEST_KEY))
    writer = frame_keys(TEST_KEY)
    assert writer.writer and not reader.writer
    assert reader.run_id == writer.run_id and reader.mac == writer.mac  # same run, same frames
    with pytest.raises(PermissionError, match="frame-read key only"):
        sign_json(reader, {"epoch": 2}, "lease")
    assert verify_json(writer, sign_json(writer, {"epoch": 2}, "lease"))
    # The reader checks the trainer's lease (public key) but its own claims pass nowhere.
    assert verify_json(reader, sign_json(writer, {"epoch": 2}, "lease"))
    assert not verify_json(writer, {"epoch": 2, "sig": "00" * 64}, "lease")


def test_an_engine_environment_resolves_to_reader_keys(monkeypatch):
    monkeypatch.delenv(RUN_KEY_ENV)
    monkeypatch.setenv(FRAME_READ_ENV, frame_read_key(TEST_KEY))
    keys = frame_keys(FROM_ENV)
    assert keys is not None and not keys.writer and keys.mac == frame_keys(TEST_KEY).mac


def test_derive_hashes_the_whole_key():
    # Two keys that share their first 64 bytes: the old derive read only those.
    a, b = "k" * 64 + "a", "k" * 64 + "b"
    assert derive(a, "weightsync-frame-mac") != derive(b, "weightsync-frame-mac")
    assert engine_bearer(a) != engine_bearer(b)


def test_every_capability_is_redacted_wherever_the_run_key_is():
    text = f"a {BEARER} b {ray_token(TEST_KEY)} c {frame_read_key(TEST_KEY)} d {TEST_KEY}"
    assert redact(text, TEST_KEY) == "a <redacted> b <redacted> c <redacted> d <redacted>"
    assert Redactor(TEST_KEY).text(text) == "a <redacted> b <redacted> c <redacted> d <redacted>"
    secret = frame_read_key(TEST_KEY).partition(".")[0]  # the frame-read key's secret part alone
    assert redact(f"x {secret} y", TEST_KEY) == Redactor(TEST_KEY).text(f"x {secret} y") == "x <redacted> y"
    # An engine container holds only its capabilities: it redacts them and their derived keys.
    held = Redactor(None, (BEARER, frame_read_key(TEST_KEY)))
    mac = derive(frame_read_key(TEST_KEY).partition(".")[0], "weightsync-frame-mac").hex()
    assert held.text(f"{BEARER} {mac}") == "<redacted> <redacted>"
