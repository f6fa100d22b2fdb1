"""What one receiver holds makes nothing another receiver accepts.

Every engine holds the frame-read key (the record-MAC and handshake secret, and the trainer's
public key). The tests play a compromised engine with that key, and also with no key and with
another part's key (the engine bearer; another run's trainer), against the records others
believe: frames, pulls, a store's ``latest`` and lease, and a frame server's hello. Only the
trainer's Ed25519 key (derived from the run key) signs them. Real sockets, real stores.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.run_key import (
    FRAME_READ_ENV,
    RUN_KEY_ENV,
    engine_bearer,
    frame_read_key,
    new_run_key,
    trainer_public_key,
)
from modal_rl.weightsync import CodecConfig, VersionChain, encode_anchor, encode_delta, frame_bytes
from modal_rl.weightsync.apply.vllm_extension import DeltaWeightsExtension, pull_request
from modal_rl.weightsync.errors import (
    CorruptFrameError,
    PullRefusedError,
    RecordMacError,
    UnsignedFrameError,
)
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.transport.lease import read_pointer
from modal_rl.weightsync.transport.store import DirectoryStore
from modal_rl.weightsync.transport.tcp import FrameServer
from modal_rl.weightsync.wire import auth
from modal_rl.weightsync.wire.auth import FrameKeys, Signer, sign_json, sign_records, verify_json
from modal_rl.weightsync.wire.epoch import MAX_EPOCH
from modal_rl.weightsync.wire.frames import stamp
from tests.weightsync_helpers import TEST_KEY, perturb, same_state

CONFIG = CodecConfig(threads=1)
READER = FrameKeys.reading(frame_read_key(TEST_KEY))
TRAINER = FrameKeys(TEST_KEY)
OTHER_RUN = FrameKeys(new_run_key())
YEAR_2057 = 2_745_000_000.0
EPOCH = 5 << 20


def _states(n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(64, 64, generator=g)}]
    for i in range(1, n):
        states.append(perturb(states[-1], 0.1, seed=i))
    return states


def _forged(records, signature_by) -> bytes:
    """A frame whose record MACs are right (the reader holds the MAC key) and whose end record
    carries ``signature_by``'s signature: a key the reader could hold, or none at all."""
    signer = Signer.__new__(Signer)
    signer.keys, signer.index, signer.prev = READER, 0, bytes(auth.MAC_SIZE)

    def sign(_keys, purpose, data):
        if signature_by is None:
            return bytes(auth.SIG_SIZE)
        return signature_by.sign(auth._message(purpose, data))

    saved, auth.sign = auth.sign, sign
    try:
        return frame_bytes(signer.sign(rec) for rec in stamp(records, READER.run_id, EPOCH))
    finally:
        auth.sign = saved


ATTACKERS = {
    "no signature": None,
    "a key the engine made": Ed25519PrivateKey.generate(),
    "another run's trainer": OTHER_RUN.signer,
    "the engine bearer as a run key": FrameKeys(engine_bearer(TEST_KEY)).signer,
}


def test_a_reader_signs_no_frame_pull_pointer_or_lease():
    with pytest.raises(PermissionError, match="frame-read key only"):
        list(sign_records(encode_anchor(_states(1)[0], version=0, config=CONFIG), READER))
    for purpose in ("lease", "pointer"):
        with pytest.raises(PermissionError, match="frame-read key only"):
            sign_json(READER, {"epoch": 1}, purpose)
    with pytest.raises(PermissionError, match="frame-read key only"):
        pull_request("127.0.0.1", 1, 0, key=READER)
    # What the reader holds is one public key, and only the run key makes the private one.
    assert READER.public.public_bytes_raw() == trainer_public_key(TEST_KEY)
    assert READER.signer is None and TRAINER.signer is not None


@pytest.mark.parametrize("attacker", list(ATTACKERS))
def test_a_frame_made_with_the_read_key_is_refused_and_the_weights_stay(attacker):
    states = _states()
    chain = VersionChain(CONFIG, key=TEST_KEY)
    chain.apply(
        sign_records(
            stamp(encode_anchor(states[0], version=0, config=CONFIG), TRAINER.run_id, EPOCH), TRAINER
        )
    )
    held = {k: v.clone() for k, v in chain.state.items()}
    zeros = {"w": torch.zeros(64, 64)}  # what a compromised engine wants the others to load
    anchor = _forged(encode_anchor(zeros, version=1, config=CONFIG), ATTACKERS[attacker])
    delta = _forged(
        encode_delta(states[0], states[1], base_version=0, version=1, config=CONFIG), ATTACKERS[attacker]
    )
    for frame in (anchor, delta):
        with pytest.raises(RecordMacError, match="trainer's signature"):
            chain.apply(frame)
        assert chain.version == 0 and same_state(chain.state, held)


def test_the_trainers_frame_is_accepted_and_its_signature_is_in_the_end_record():
    states = _states()
    chain = VersionChain(CONFIG, key=READER)  # an engine's chain: the read key alone
    raw = list(
        sign_records(
            stamp(encode_anchor(states[0], version=0, config=CONFIG), TRAINER.run_id, EPOCH), TRAINER
        )
    )
    assert raw[-1][:1] == b"e" and auth.trailer_size(b"e") == 8 + auth.MAC_SIZE + auth.SIG_SIZE
    assert all(auth.trailer_size(r[:1]) == 8 + auth.MAC_SIZE for r in raw[:-1])  # one signature
    chain.apply(raw)
    assert chain.version == 0 and same_state(chain.state, states[0])


# -- pulls: a compromised engine points another at its own frame server -------------------------


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    monkeypatch.setenv(FRAME_READ_ENV, frame_read_key(TEST_KEY))
    ext = DeltaWeightsExtension()
    yield ext
    sub = getattr(ext, "_modal_rl_subscriber", None)
    if sub is not None:
        sub.source.close()


def _pull_args(signed_by: FrameKeys, **fields) -> tuple[str, str]:
    args = {"host": "127.0.0.1", "port": 9, "tls": False, "version": 0, "timeout_s": 1.0}
    args |= {"max_refusals": 0, "issued": time.time(), "nonce": auth.new_nonce()} | fields
    request = json.dumps(args, sort_keys=True)
    if signed_by is READER:  # what the old shared pull key let every engine make
        import hashlib
        import hmac

        key = auth.derive(frame_read_key(TEST_KEY).partition(".")[0], "weightsync-pull")
        return request, hmac.new(key, request.encode(), hashlib.sha256).hexdigest()
    return request, auth.sign(signed_by, "pull", request.encode()).hex()


@pytest.mark.parametrize("who", ["reader", "another run's trainer", "the engine bearer", "unsigned"])
def test_a_pull_not_signed_by_the_trainer_is_refused_before_dialling(engine, who):
    keys = {
        "reader": READER,
        "another run's trainer": OTHER_RUN,
        "the engine bearer": FrameKeys(engine_bearer(TEST_KEY)),  # another part's key, as a run key
        "unsigned": TRAINER,
    }[who]
    request, signature = _pull_args(keys, epoch=MAX_EPOCH)
    if who == "unsigned":
        signature = ""
    with pytest.raises(PullRefusedError, match="signed|signature"):
        engine._modal_rl_verified_subscriber(request, signature)
    assert getattr(engine, "_modal_rl_subscriber", None) is None


def test_a_pull_claiming_an_epoch_not_yet_started_is_refused_even_from_the_trainer(engine):
    for epoch in (MAX_EPOCH, int(YEAR_2057 * 1000) << 20):
        request, signature = _pull_args(TRAINER, epoch=epoch)
        with pytest.raises(PullRefusedError, match="epoch"):
            engine._modal_rl_verified_subscriber(request, signature)
    assert getattr(engine, "_modal_rl_subscriber", None) is None


# -- a store's latest and lease -----------------------------------------------------------------


def _pointer(keys_or_sig, **fields) -> dict:
    body = {"run": TRAINER.run_id, "epoch": EPOCH, "version": 9, "kind": "anchor", "anchor": 9}
    body |= {"at": time.time()} | fields
    if isinstance(keys_or_sig, FrameKeys):
        return sign_json(keys_or_sig, body, "pointer")
    return body | {"sig": keys_or_sig.sign(auth._message("pointer", auth._canonical(body))).hex()}


@pytest.mark.parametrize("forged", ["an engine's key", "another run", "epoch 2**64-1", "at in 2057"])
def test_a_forged_or_unbounded_latest_neither_stops_nor_misleads_the_next_trainer(tmp_path, forged):
    first = Publisher(DirectoryStore(tmp_path, key=TEST_KEY), config=CONFIG)
    first.publish(_states(1)[0])
    first.sink.close()
    pointer = {
        "an engine's key": _pointer(Ed25519PrivateKey.generate(), epoch=MAX_EPOCH),
        "another run": _pointer(OTHER_RUN.signer, epoch=MAX_EPOCH),
        "epoch 2**64-1": _pointer(TRAINER, epoch=MAX_EPOCH),  # even the trainer's own key
        "at in 2057": _pointer(TRAINER, epoch=first.epoch + 1, at=YEAR_2057),
    }[forged]
    (tmp_path / "latest").write_text(json.dumps(pointer))
    with pytest.raises((RecordMacError, CorruptFrameError)):
        read_pointer(tmp_path / "latest", READER)
    # The next trainer starts at once (before: ValueError at epoch 2**64-1; LeaseHeldError
    # until 2057) and publishes after the first.
    second = Publisher(DirectoryStore(tmp_path, key=TEST_KEY, lease_wait_s=0), config=CONFIG)
    assert first.epoch < second.epoch < MAX_EPOCH
    second.publish(_states(1)[0])
    assert read_pointer(tmp_path / "latest", READER)["epoch"] == second.epoch
    second.sink.close()


@pytest.mark.parametrize("claim", ["epoch 2**64-1", "expires in 2057", "ttl of a year"])
def test_a_lease_claiming_too_much_holds_nothing(tmp_path, claim):
    first = Publisher(DirectoryStore(tmp_path, key=TEST_KEY, heartbeat=False), config=CONFIG)
    first.publish(_states(1)[0])
    record = json.loads((tmp_path / "lease").read_text())
    record.pop("sig")
    record["holder"] = "elsewhere:1:abcdef"
    record |= {
        "epoch 2**64-1": {"epoch": MAX_EPOCH},
        "expires in 2057": {"expires_at": YEAR_2057, "epoch": first.epoch + 1},
        "ttl of a year": {"ttl_s": 3.2e7, "expires_at": time.time() + 3.2e7, "epoch": first.epoch + 1},
    }[claim]
    (tmp_path / "lease").write_text(json.dumps(sign_json(TRAINER, record)))  # signed, still refused
    first.sink.lease.release()
    time.sleep(0.4)  # ``latest`` older than a ttl: only the lease record could hold the store now
    second = Publisher(DirectoryStore(tmp_path, key=TEST_KEY, lease_wait_s=0, lease_ttl_s=0.3), config=CONFIG)
    assert second.epoch < MAX_EPOCH
    second.publish(_states(1)[0])
    second.sink.close()
    first.sink.close()


def test_a_store_refuses_a_pointer_signed_with_the_old_shared_pointer_key(tmp_path):
    body = _pointer(TRAINER)
    body.pop("sig")
    import hashlib
    import hmac

    key = auth.derive(frame_read_key(TEST_KEY).partition(".")[0], "weightsync-latest")
    canonical = auth._canonical(body)
    (tmp_path / "latest").write_text(
        json.dumps(body | {"mac": hmac.new(key, canonical, hashlib.sha256).hexdigest()})
    )
    with pytest.raises(UnsignedFrameError):
        read_pointer(tmp_path / "latest", READER)


# -- a frame server's hello ---------------------------------------------------------------------


def _hello(server: FrameServer, keys: FrameKeys, epoch: int) -> str:
    """Pass the handshake with ``keys`` claiming ``epoch``; the server's answer after it."""
    line, nonce = auth.hello_line(0, keys, epoch=epoch)
    with socket.create_connection(server.address, timeout=5) as sock:
        stream = sock.makefile("rwb")
        stream.write(line)
        stream.flush()
        theirs = auth.check_server_hello(stream.readline(), keys, nonce, "test")
        proof = auth.client_proof(keys, nonce, theirs, line)
        stream.write(json.dumps({"proof": proof}).encode() + b"\n")
        stream.flush()
        return stream.readline().decode()


@pytest.mark.parametrize("epoch", [MAX_EPOCH, "newer"])
def test_a_hello_claiming_a_newer_epoch_does_not_stop_the_live_trainer(epoch):
    states = _states(3)
    server = FrameServer(key=TEST_KEY, keep_anchors=1)
    try:
        trainer = Publisher(server, config=CONFIG)
        trainer.publish(states[0])
        claim = trainer.epoch + 1 if epoch == "newer" else epoch
        answer = _hello(server, READER, claim)
        assert "error" in answer and "\n" not in answer.strip()
        assert server.epoch == trainer.epoch
        assert trainer.publish(states[1]).version == 1  # before: LeaseLostError, for good
        assert trainer.publish(states[2]).version == 2
    finally:
        server.close()


def test_the_engine_bearer_is_no_frame_read_key():
    with pytest.raises(ValueError, match="no trainer public key"):
        FrameKeys.reading(engine_bearer(TEST_KEY))


# -- fuzz: the new parsers take anything and answer with a refusal, never a crash ---------------


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_fuzz_a_frame_read_key_text_is_keys_or_one_clear_refusal(text):
    try:
        keys = FrameKeys.reading(text)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    assert keys.signer is None and not keys.writer  # whatever it parsed, it signs nothing


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), JSONISH, max_size=6), st.one_of(JSONISH, st.text(max_size=140)))
def test_fuzz_a_signed_record_that_the_trainer_did_not_sign_never_verifies(body, sig):
    record = {k: v for k, v in body.items() if k != "sig"} | {"sig": sig}
    for purpose in ("lease", "pointer"):
        assert verify_json(READER, record, purpose) is False
        assert verify_json(TRAINER, record, purpose) is False


_SIGNED: list[bytes] = []


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=100))
def test_fuzz_an_end_record_with_any_other_trailer_is_refused(trailer):
    if not _SIGNED:
        frame = stamp(encode_anchor(_states(1)[0], version=0, config=CONFIG), TRAINER.run_id, EPOCH)
        _SIGNED.extend(sign_records(frame, TRAINER))
    verifier = auth.Verifier(READER)
    for rec in _SIGNED[:-1]:
        verifier.check(rec)
    end = _SIGNED[-1]
    kept = len(end) - auth.SIG_SIZE  # tag, length, body, digest and MAC; the signature replaced
    if end[kept:] == trailer:
        return
    with pytest.raises((RecordMacError, CorruptFrameError)):
        verifier.check(end[:kept] + trailer)
