"""The ``RANS0`` stream method: bit-exact round trips, sparse chunks coded with it, bodies
coded the earlier way (Huffman-only DEFLATE planes) still decoding, and damaged payloads
refused with ``CorruptFrameError`` (never another exception, never a read out of bounds)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modal_rl.weightsync.codec import rans0
from modal_rl.weightsync.codec.codings import chunks
from modal_rl.weightsync.codec.streams import HUFFMAN, RANS0, ZSTD, _read_varint, pack_streams, unpack_streams
from modal_rl.weightsync.errors import CorruptFrameError


def skewed(rng: np.random.Generator, n: int) -> np.ndarray:
    # most bytes one or two (a SUB residual's low byte at 1-2 ulp steps), a noisy tail
    return np.minimum(rng.geometric(0.45, n), 255).astype(np.uint8)


def one_rans0_stream(data: np.ndarray) -> bytes:
    body = pack_streams([data], [RANS0], 1)
    assert _read_varint(memoryview(body), 0)[0] == RANS0
    return body


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 5000),
    kind=st.sampled_from(["skewed", "uniform", "one", "two", "sparse-alphabet"]),
    seed=st.integers(0, 2**16),
)
def test_payloads_round_trip_bit_exact(n, kind, seed):
    rng = np.random.default_rng(seed)
    data = {
        "skewed": lambda: skewed(rng, n),
        "uniform": lambda: rng.integers(0, 256, n, dtype=np.uint8),
        "one": lambda: np.full(n, 255, np.uint8),
        "two": lambda: rng.choice(np.array([0, 255], np.uint8), n, p=[0.999, 0.001]),
        "sparse-alphabet": lambda: rng.choice(np.array([3, 77, 128, 200], np.uint8), n),
    }[kind]()
    payload = rans0.encode(data)
    if payload is None:  # not smaller than the bytes themselves: the stream is stored
        body = pack_streams([data], [RANS0], 1)
        assert _read_varint(memoryview(body), 0)[0] == 0
        return
    assert len(payload) < n
    decoded = rans0.decode(bytes(payload), n)
    assert decoded is not None and np.array_equal(decoded, data)
    (raw,) = unpack_streams(memoryview(pack_streams([data], [RANS0], 1)), 0, 1, n)
    assert np.array_equal(np.frombuffer(raw, np.uint8), data)


def test_a_skewed_plane_codes_near_its_order0_entropy():
    data = skewed(np.random.default_rng(0), 100_000)
    counts = np.bincount(data)
    counts = counts[counts > 0]
    entropy_bytes = -(counts * np.log2(counts / data.size)).sum() / 8
    payload = rans0.encode(data)
    # within the table and states (< 600 bytes) and the 12-bit frequencies' rounding
    assert len(payload) < 1.01 * entropy_bytes + 600


def sparse_changes(count: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(count, k, replace=False)).astype(np.int64)
    old = rng.integers(0x3000, 0x3F00, k, dtype=np.uint16)  # bf16 patterns of one sign
    new = (old + rng.choice(np.array([-2, -1, 1, 2]), k)).astype(np.uint16)
    return positions, old, new


def stream_methods(body: bytes) -> list[int]:
    view, offset, methods = memoryview(body), chunks.CHUNK_HEADER.size, []
    while offset < len(view):
        method, offset = _read_varint(view, offset)
        _, offset = _read_varint(view, offset)
        stored, offset = _read_varint(view, offset)
        methods.append(method)
        offset += stored
    return methods


def test_sparse_chunks_code_their_noisy_plane_with_rans0_and_decode_exactly():
    positions, old, new = sparse_changes(1 << 20, 10_000, seed=1)
    spec = chunks.ChunkSpec(0, 0, 1 << 20)
    body = chunks.encode_delta_chunk(spec, positions, old, new, 1)
    assert RANS0 in stream_methods(body)
    decoded = chunks.decode_chunk(body, 2, 1 << 20)
    assert decoded.encoding == chunks.SUB_SPARSE
    words = np.zeros(1 << 20, np.uint16)
    words[positions] = old
    decoded.apply([(0, words)])
    expected = np.zeros(1 << 20, np.uint16)
    expected[positions] = new
    assert np.array_equal(words, expected)


def test_bodies_coded_with_huffman_planes_still_decode(monkeypatch):
    positions, old, new = sparse_changes(1 << 20, 10_000, seed=2)
    spec = chunks.ChunkSpec(0, 0, 1 << 20)
    monkeypatch.setattr(chunks, "SPARSE_NOISY", HUFFMAN)
    earlier = chunks.encode_delta_chunk(spec, positions, old, new, 1)
    monkeypatch.undo()
    now = chunks.encode_delta_chunk(spec, positions, old, new, 1)
    assert HUFFMAN in stream_methods(earlier) and RANS0 not in stream_methods(earlier)
    for body in (earlier, now):
        decoded = chunks.decode_chunk(body, 2, 1 << 20)
        assert np.array_equal(decoded.positions, positions)
        assert np.array_equal((old + decoded.values).astype(np.uint16), new)
    assert len(now) < len(earlier)


def expect_refused(body: bytes, raw_len: int) -> None:
    with pytest.raises(CorruptFrameError):
        unpack_streams(memoryview(body), 0, 1, raw_len)


PLANE = skewed(np.random.default_rng(3), 20_000)
BODY = one_rans0_stream(PLANE)
HEAD = len(pack_streams([PLANE], [RANS0], 1)) - len(rans0.encode(PLANE))


def with_payload(payload: bytes, raw_len: int = PLANE.size) -> bytes:
    from modal_rl.weightsync.codec.streams import _varint

    return _varint(RANS0) + _varint(raw_len) + _varint(len(payload)) + payload


def test_every_truncation_of_a_payload_is_refused():
    payload = BODY[HEAD:]
    for cut in list(range(0, 700)) + list(range(700, len(payload), 97)):
        expect_refused(with_payload(payload[:cut]), PLANE.size)


def table_end(payload: bytes) -> int:
    present = sum(bin(b).count("1") for b in payload[: rans0.BITMAP])
    at = rans0.BITMAP
    for _ in range(present):
        at += 2 if payload[at] & 0x80 else 1
    return at


def test_a_wrong_length_or_damaged_table_or_states_are_refused():
    payload = BODY[HEAD:]
    expect_refused(with_payload(payload, PLANE.size + 1), PLANE.size + 1)
    expect_refused(with_payload(payload, PLANE.size - 1), PLANE.size)
    expect_refused(with_payload(bytes(32) + payload[32:]), PLANE.size)  # no value has a frequency
    expect_refused(with_payload(b"\xff" * 32 + payload[32:]), PLANE.size)  # frequencies do not parse or sum
    lone = b"\x01" + bytes(31) + b"\x80\x20" + rans0.RANS_L.to_bytes(8, "little") * rans0.LANES
    expect_refused(with_payload(lone, 10), 10)  # one value with all of M: a state could overflow
    states = table_end(payload)
    for lane in range(rans0.LANES):
        at = states + 8 * lane
        low = payload[:at] + (rans0.RANS_L - 1).to_bytes(8, "little") + payload[at + 8 :]
        expect_refused(with_payload(low), PLANE.size)
        high = payload[:at] + (1 << 63).to_bytes(8, "little") + payload[at + 8 :]
        expect_refused(with_payload(high), PLANE.size)
    last_word = bytearray(payload)
    last_word[-1] ^= 0x80  # the lanes no longer end in the encoder's initial state
    expect_refused(with_payload(bytes(last_word)), PLANE.size)
    expect_refused(with_payload(payload + bytes(4)), PLANE.size)  # a word nobody reads


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=400), raw_len=st.integers(0, 4096))
def test_garbage_payloads_are_refused_or_decode_in_bounds(data, raw_len):
    body = with_payload(data, raw_len)
    try:
        (raw,) = unpack_streams(memoryview(body), 0, 1, 4096)
    except CorruptFrameError:
        return
    assert len(raw) == raw_len


@settings(max_examples=150, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
def test_damaged_payloads_are_refused_or_decode_to_the_right_length(flips):
    payload = bytearray(BODY[HEAD:])
    for at, mask in flips:
        payload[at % len(payload)] ^= mask
    try:
        (raw,) = unpack_streams(memoryview(with_payload(bytes(payload))), 0, 1, PLANE.size)
    except CorruptFrameError:
        return
    assert len(raw) == PLANE.size  # a flip in a word can decode: the record digest catches it


def test_zstd_and_rans0_streams_share_a_body():
    planes = [PLANE, np.zeros(5000, np.uint8), skewed(np.random.default_rng(9), 3)]
    body = pack_streams(planes, [RANS0, ZSTD, RANS0], 1)
    out = unpack_streams(memoryview(body), 0, 3, 20_000)
    assert all(np.array_equal(np.frombuffer(o, np.uint8), p) for o, p in zip(out, planes, strict=True))


def test_without_numba_rans0_streams_are_coded_with_huffman_and_read_as_a_refusal(monkeypatch):
    import sys

    import modal_rl.weightsync.codec as codec

    monkeypatch.setitem(sys.modules, "modal_rl.weightsync.codec.rans0", None)  # import fails
    monkeypatch.delattr(codec, "rans0")
    body = pack_streams([PLANE], [RANS0], 1)
    assert _read_varint(memoryview(body), 0)[0] == HUFFMAN
    (raw,) = unpack_streams(memoryview(body), 0, 1, PLANE.size)
    assert np.array_equal(np.frombuffer(raw, np.uint8), PLANE)
    with pytest.raises(CorruptFrameError, match="needs numba"):
        unpack_streams(memoryview(BODY), 0, 1, PLANE.size)


def test_a_published_delta_carries_rans0_planes_and_applies_bit_exact(monkeypatch):
    import torch

    from modal_rl.weightsync import CodecConfig, VersionChain, encode_anchor, encode_delta, frame_bytes
    from tests.weightsync_helpers import model_state, same_state

    base = model_state(seed=4)
    new = {}
    gen = torch.Generator().manual_seed(5)
    for name, t in base.items():  # 1% of words, one or two ulps (a real step's residuals)
        words = t.reshape(-1).view(torch.int16).clone()
        where = torch.rand(words.numel(), generator=gen) < 0.01
        words[where] += torch.randint(1, 3, (int(where.sum()),), generator=gen, dtype=torch.int16)
        new[name] = words.view(torch.bfloat16).reshape(t.shape)
    decoded = []
    real_decode = rans0.decode
    monkeypatch.setattr(rans0, "decode", lambda payload, n: decoded.append(n) or real_decode(payload, n))
    config = CodecConfig(chunk_elems=1 << 16, threads=2)
    chain = VersionChain(config, key=None)
    chain.apply(encode_anchor(base, version=0, config=config))
    chain.apply(frame_bytes(encode_delta(base, new, base_version=0, version=1, config=config)))
    assert decoded, "no RANS0 stream on the wire"
    assert same_state(chain.state, new)
