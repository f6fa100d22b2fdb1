"""Chunk coding v2 (context-conditioned): round trips, the v1 fallback and v1
frames, refusals of damaged v2 chunks with the held state unchanged."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modal_rl.weightsync import (
    CodecConfig,
    CorruptFrameError,
    NumpyDiffer,
    TorchDiffer,
    VersionChain,
    WeightSyncError,
    apply_frame,
    encode_anchor,
    encode_delta,
    frame_bytes,
)
from modal_rl.weightsync.codec.codings.chunks import CHUNK_HEADER, CTX_SPARSE, ENCODING_NAMES
from tests.weightsync_helpers import clone_state, perturb, records, reseal, same_state

SLOW = 1e3  # bytes per second: a declared link so slow that any v2 saving pays for its pass
V2 = CodecConfig(chunk_elems=1 << 14, threads=2, link_bytes_per_s=SLOW)
V1 = CodecConfig(chunk_elems=1 << 14, threads=2, coding=1)


def adam_like(shapes: dict[str, tuple[int, ...]], lr: float, seed: int = 0):
    """(base, new): bf16 casts of fp32 master weights before and after one step of about
    ``lr`` — small weights change by several ulps, large ones mostly not at all."""
    gen = torch.Generator().manual_seed(seed)
    base, new = {}, {}
    for name, shape in shapes.items():
        master = torch.randn(shape, generator=gen) * 0.02
        step = torch.randn(shape, generator=gen) * lr
        base[name] = master.to(torch.bfloat16)
        new[name] = (master + step).to(torch.bfloat16)
    return base, new


SHAPES = {"embed": (300, 128), "q": (128, 128), "bias": (128,), "norm": (128,), "mlp": (700, 128), "s": ()}
BASE, NEW = adam_like(SHAPES, 3e-5)


def chunk_encodings(frame: bytes) -> list[int]:
    return [CHUNK_HEADER.unpack_from(frame, o + 5)[3] for o, _, tag in records(frame) if tag == b"C"]


def fresh_chain(config=V2) -> VersionChain:
    chain = VersionChain(config, key=None)
    chain.apply(encode_anchor(BASE, version=0, config=config))
    return chain


DELTA = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=V2))


def test_v2_chunks_carry_an_adam_update_bit_exactly_in_fewer_bytes():
    assert ENCODING_NAMES[CTX_SPARSE] == "ctx-sparse"
    assert CTX_SPARSE in chunk_encodings(DELTA)
    v1 = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=V1))
    assert CTX_SPARSE not in chunk_encodings(v1)
    assert len(DELTA) < 0.85 * len(v1)
    chain = fresh_chain()
    chain.apply(DELTA)
    assert same_state(chain.state, NEW)


def test_v1_frames_still_decode():
    # A frame made by the v1 encoder path, read by a default (v2) reader.
    v1 = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=V1))
    chain = fresh_chain()
    chain.apply(v1)
    assert same_state(chain.state, NEW)


def test_each_chunk_keeps_the_smaller_coding():
    # Uniform low-byte noise has no context to exploit: v2 must not make the frame larger.
    noisy = perturb(BASE, 0.05, seed=4)
    for new in (NEW, noisy):
        v1 = frame_bytes(encode_delta(BASE, new, base_version=0, version=1, config=V1))
        v2 = frame_bytes(encode_delta(BASE, new, base_version=0, version=1, config=V2))
        assert len(v2) <= len(v1)


def test_torch_differ_writes_the_same_v2_bytes_as_numpy():
    frames = [
        frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=V2, differ=d))
        for d in (NumpyDiffer(), TorchDiffer())
    ]
    assert frames[0] == frames[1]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.lists(st.integers(0, 300), min_size=0, max_size=2).map(tuple), min_size=1, max_size=5),
    lr=st.sampled_from([1e-6, 1e-5, 1e-4, 1e-2]),
    chunk_elems=st.sampled_from([64, 1000, 1 << 14]),
    seed=st.integers(0, 2**16),
)
def test_v2_round_trips_are_bit_exact(shapes, lr, chunk_elems, seed):
    base, new = adam_like({f"t{i}": s for i, s in enumerate(shapes)}, lr, seed)
    config = CodecConfig(chunk_elems=chunk_elems, threads=2, link_bytes_per_s=SLOW)
    chain = VersionChain(config, key=None)
    chain.apply(encode_anchor(base, version=0, config=config))
    chain.apply(frame_bytes(encode_delta(base, new, base_version=0, version=1, config=config)))
    assert same_state(chain.state, new)


def ctx_chunk_records() -> list[tuple[int, int]]:
    return [(o, s) for o, s, tag in records(DELTA) if tag == b"C" and DELTA[o + 5 + 12] == CTX_SPARSE]


def assert_refused(frame: bytes) -> None:
    chain = fresh_chain()
    with pytest.raises(WeightSyncError):
        chain.apply(frame)
    assert chain.version == 0 and same_state(chain.state, BASE)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_flipped_bit_in_a_v2_chunk_is_refused(data):
    offset, size = data.draw(st.sampled_from(ctx_chunk_records()))
    bit = data.draw(st.integers(0, size * 8 - 1))
    frame = bytearray(DELTA)
    frame[offset + bit // 8] ^= 1 << (bit % 8)
    assert_refused(bytes(frame))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_truncation_inside_a_v2_chunk_is_refused(data):
    offset, size = data.draw(st.sampled_from(ctx_chunk_records()))
    assert_refused(DELTA[: offset + data.draw(st.integers(0, size - 1))])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_v2_chunk_damage_behind_a_valid_record_digest_is_refused_and_rolled_back(data):
    # The record digest is recomputed, so only the chunk's own checks (and the tensor
    # checksums) stand between the damage and the held words. Later chunks fail after
    # earlier v2 chunks were applied: their rollback must restore the held words exactly.
    offset, size = data.draw(st.sampled_from(ctx_chunk_records()))
    body = bytearray(DELTA[offset + 5 : offset + size - 8])
    at = data.draw(st.integers(CHUNK_HEADER.size, len(body) - 1))
    body[at] ^= data.draw(st.integers(1, 255))
    assert_refused(reseal(DELTA, offset, bytes(body)))


def test_a_v2_chunk_against_other_held_words_is_refused_with_them_unchanged():
    held = clone_state(NEW)  # not the base: the context model does not fit these words
    with pytest.raises((CorruptFrameError, WeightSyncError)):
        apply_frame(held, io.BytesIO(DELTA), held_version=0, config=V2, key=None)
    assert same_state(held, NEW)


def test_a_v2_chunk_failing_at_its_end_puts_back_every_word_it_wrote():
    # v2 decodes into the held words as it goes. Damage in the residual stream's last
    # word lets the pass write (nearly) every change before the final check refuses the
    # chunk: the words written must all go back.
    from modal_rl.weightsync.codec.codings import chunks_v2

    base, new = adam_like({"w": (600, 128), "v": (300, 128)}, 3e-5, seed=3)
    b_parts = [t.reshape(-1).view(torch.int16).numpy().view(np.uint16).copy() for t in base.values()]
    n_parts = [t.reshape(-1).view(torch.int16).numpy().view(np.uint16) for t in new.values()]
    starts, count = [0, b_parts[0].size], sum(p.size for p in b_parts)
    body, positions, _, _ = chunks_v2.encode(
        lambda k: CHUNK_HEADER.pack(0, count, k, CTX_SPARSE, chunks_v2.CTX_STREAMS),
        b_parts,
        n_parts,
        starts,
        1,
    )
    assert positions.size > 1000
    held = [p.copy() for p in b_parts]
    good = chunks_v2.decode(memoryview(body), 0, count, positions.size, held, starts)
    assert all((h == n).all() for h, n in zip(held, n_parts, strict=True))  # decoded in place
    assert (good[0] == positions).all()
    damaged = bytearray(body)
    damaged[-1] ^= 0x40  # the residual stream is the last one
    held = [p.copy() for p in b_parts]
    with pytest.raises(CorruptFrameError):
        chunks_v2.decode(memoryview(bytes(damaged)), 0, count, positions.size, held, starts)
    assert all((h == b).all() for h, b in zip(held, b_parts, strict=True))


def test_v2_streams_are_near_the_context_entropy_bound():
    from benchmarks._weight_sync_codecs import context_entropy_bytes

    base, new = adam_like({"w": (1 << 20,)}, 2e-5, seed=3)
    config = CodecConfig(chunk_elems=1 << 20, threads=1, link_bytes_per_s=SLOW)
    frame = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=config))
    chunks = [(o, s) for o, s, tag in records(frame) if tag == b"C"]
    assert [frame[o + 5 + 12] for o, _ in chunks] == [CTX_SPARSE]
    payload = sum(s - 13 - CHUNK_HEADER.size for _, s in chunks)
    bound = context_entropy_bytes(base, new)
    assert 0.97 * bound < payload < 1.05 * bound, payload / bound
    assert np.isfinite(bound)


def test_with_the_link_rate_unknown_no_chunk_is_coded_v2(monkeypatch):
    # v2 passes over every word of a chunk on both sides; it pays only on a slow link, so
    # without a known rate the encoder never runs it (not even to compare sizes).
    from modal_rl.weightsync.codec.codings import chunks_v2

    def no_v2(*args, **kwargs):
        raise AssertionError("v2 coded without a known link rate")

    monkeypatch.setattr(chunks_v2, "encode", no_v2)
    unknown = CodecConfig(chunk_elems=1 << 14, threads=2)
    for differ in (NumpyDiffer(), TorchDiffer()):
        frame = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=unknown, differ=differ))
        assert CTX_SPARSE not in chunk_encodings(frame)
        chain = fresh_chain()
        chain.apply(frame)
        assert same_state(chain.state, NEW)


def test_the_run_length_tables_are_the_same_on_every_machine():
    # Encoder and decoder must hold the same tables bit for bit; they are made in decimal,
    # not with the platform's libm, and pinned here so a machine that differs fails loudly.
    import xxhash

    from modal_rl.weightsync.codec.codings.ctxcoder import GEO

    assert xxhash.xxh3_64_hexdigest(GEO.astype("<i8").tobytes()) == "6ff3e605e7638f03"


def test_the_residual_model_tables_are_the_exact_integer_formula():
    # The rebuild computes its floors through a corrected float product; any table that
    # differed from the integer formula would make frames undecodable across builds.
    from modal_rl.weightsync.codec.codings.ctxrans import M
    from modal_rl.weightsync.codec.codings.ctxresidual import RES_SYM, _rebuild

    rng = np.random.default_rng(7)
    for scale in (1, 40, 10**4, 10**8, 2**33):
        counts = rng.integers(1, scale + 1, size=(64, RES_SYM)).astype(np.int64)
        counts[::3, 1] = scale * 32  # one dominant symbol, as after many observations
        cum = np.zeros((64, RES_SYM + 1), np.int64)
        for c in range(64):
            _rebuild(counts, cum, c)
            freq = np.maximum(1, counts[c] * (M - RES_SYM) // counts[c].sum())
            freq[np.argmax(freq)] += M - freq.sum()
            assert (np.diff(cum[c]) == freq).all() and cum[c, 0] == 0 and cum[c, -1] == M
