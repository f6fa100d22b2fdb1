"""Refusals: every bad frame raises a typed error and leaves the held state bit-identical."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modal_rl.weightsync import (
    BaseMismatchError,
    ChecksumMismatchError,
    CodecConfig,
    CorruptFrameError,
    LayoutMismatchError,
    StaleVersionError,
    TruncatedFrameError,
    VersionChain,
    WeightSyncError,
    apply_frame,
    encode_anchor,
    encode_delta,
    frame_bytes,
)
from modal_rl.weightsync.codec.dtypes import words_of
from tests.weightsync_helpers import clone_state, model_state, perturb, records, reseal, same_state

CONFIG = CodecConfig(chunk_elems=2048, threads=2)
BASE = model_state()
NEW = perturb(BASE, 0.05, seed=1)
ANCHOR = frame_bytes(encode_anchor(BASE, version=0, config=CONFIG))
DELTA = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=CONFIG))


def fresh_chain() -> VersionChain:
    chain = VersionChain(CONFIG, key=None)
    chain.apply(ANCHOR)
    return chain


def assert_refused(chain: VersionChain, frame: bytes, error=WeightSyncError) -> None:
    before = clone_state(chain.state)
    with pytest.raises(error):
        chain.apply(frame)
    assert chain.version == 0
    assert same_state(chain.state, before)
    assert same_state(chain.state, BASE)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(0, len(DELTA) * 8 - 1))
def test_any_flipped_bit_is_refused(position):
    frame = bytearray(DELTA)
    frame[position // 8] ^= 1 << (position % 8)
    assert_refused(fresh_chain(), bytes(frame))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(0, len(DELTA) - 1))
def test_any_truncation_is_refused(cut):
    assert_refused(fresh_chain(), DELTA[:cut])


def test_truncation_at_a_record_boundary_is_refused_as_truncated():
    last = records(DELTA)[-1][0]  # drop the end record: every earlier record is intact
    assert_refused(fresh_chain(), DELTA[:last], TruncatedFrameError)


def test_reordered_chunks_are_refused():
    recs = records(DELTA)
    chunks = [r for r in recs if r[2] == b"C"]
    (o1, s1, _), (o2, s2, _) = chunks[0], chunks[1]
    assert o1 + s1 == o2, "the first two chunks must be adjacent for this test"
    swapped = DELTA[:o1] + DELTA[o2 : o2 + s2] + DELTA[o1 : o1 + s1] + DELTA[o2 + s2 :]
    assert_refused(fresh_chain(), swapped, CorruptFrameError)


def test_wrong_words_with_valid_record_checksums_fail_the_tensor_checksum():
    # Flip a byte inside a chunk's stored data and reseal the record: only the checksum
    # of the rebuilt tensor can catch it, after the chunk was applied, so this exercises rollback.
    chain = fresh_chain()
    offset, size, _ = next(r for r in records(DELTA) if r[2] == b"C")
    body = bytearray(DELTA[offset + 5 : offset + size - 8])
    body[-1] ^= 0x01
    frame = reseal(DELTA, offset, bytes(body))
    assert_refused(chain, frame, (ChecksumMismatchError, CorruptFrameError))


def test_rollback_restores_earlier_groups_when_a_later_one_fails():
    chain = fresh_chain()
    last_chunk = [r for r in records(DELTA) if r[2] == b"C"][-1]
    offset, size, _ = last_chunk
    body = bytearray(DELTA[offset + 5 : offset + size - 8])
    body[-1] ^= 0x01
    assert_refused(chain, reseal(DELTA, offset, bytes(body)), (ChecksumMismatchError, CorruptFrameError))


def test_delta_for_another_base_version_is_refused():
    chain = fresh_chain()
    other = frame_bytes(encode_delta(NEW, BASE, base_version=5, version=6, config=CONFIG))
    assert_refused(chain, other, BaseMismatchError)


def test_delta_made_from_other_weights_is_refused_up_front():
    chain = fresh_chain()
    other_base = perturb(BASE, 0.01, seed=9)
    lying = frame_bytes(encode_delta(other_base, NEW, base_version=0, version=1, config=CONFIG))
    assert_refused(chain, lying, BaseMismatchError)


@pytest.mark.parametrize("fmt", [1, 2])
def test_without_held_checksums_a_wrong_base_is_refused_before_any_word_is_written(fmt):
    # A caller that kept no sums has its held tensors summed in full first, and the version
    # header's base digest refuses the delta before any chunk is decoded.
    config = CodecConfig(chunk_elems=2048, threads=2, coding=fmt)
    delta = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=config))
    held = perturb(BASE, 0.01, seed=9)
    before = clone_state(held)
    with pytest.raises(BaseMismatchError, match="other weights"):
        apply_frame(held, io.BytesIO(delta), held_version=0, config=config, key=None)
    assert same_state(held, before)


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_receiver_wrong_about_its_base_is_caught_by_the_moved_sums(fmt):
    # Sums that claim the base while the held words differ in a few places the delta touches:
    # v1 chunks apply, and the sums they moved differ from the S record's; v2 chunks are
    # modelled on the held words and may fail to decode first. Either way nothing changes.
    config = CodecConfig(chunk_elems=2048, threads=2, coding=fmt)
    base_sums: dict[str, str] = {}
    frame_bytes(encode_anchor(BASE, version=0, config=config, checksums_out=base_sums))
    delta = frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=config))
    held = clone_state(BASE)
    name = next(iter(held))
    moved = np.flatnonzero(words_of(NEW[name]) != words_of(BASE[name]))
    words_of(held[name])[moved[: max(1, moved.size // 10)]] ^= 1  # damage where the delta writes
    before = clone_state(held)
    with pytest.raises(ChecksumMismatchError if fmt == 1 else (ChecksumMismatchError, CorruptFrameError)):
        apply_frame(
            held, io.BytesIO(delta), held_version=0, held_checksums=base_sums, config=config, key=None
        )
    assert same_state(held, before)


def test_stale_and_replayed_frames_are_refused():
    chain = fresh_chain()
    chain.apply(DELTA)
    snapshot = clone_state(chain.state)
    for frame in (DELTA, ANCHOR):
        with pytest.raises(StaleVersionError):
            chain.apply(frame)
    assert chain.version == 1 and same_state(chain.state, snapshot)


def test_delta_before_any_anchor_is_refused():
    with pytest.raises(BaseMismatchError, match="anchor first"):
        VersionChain(CONFIG, key=None).apply(DELTA)


def test_layout_change_is_refused():
    chain = fresh_chain()
    reshaped = clone_state(BASE)
    reshaped["layer.0.q.weight"] = reshaped["layer.0.q.weight"].reshape(32, 128)
    held = clone_state(reshaped)
    new = perturb(reshaped, 0.05)
    frame = frame_bytes(encode_delta(reshaped, new, base_version=0, version=1, config=CONFIG))
    assert_refused(chain, frame, (LayoutMismatchError, BaseMismatchError))
    with pytest.raises(LayoutMismatchError):
        apply_frame(clone_state(BASE), io.BytesIO(frame), held_version=0, config=CONFIG, key=None)
    assert same_state(held, reshaped)


def test_garbage_and_empty_input_are_refused():
    chain = fresh_chain()
    assert_refused(chain, b"", TruncatedFrameError)
    assert_refused(chain, b"not a frame at all, just some bytes", CorruptFrameError)


def test_bad_anchor_leaves_the_chain_untouched():
    chain = fresh_chain()
    anchor2 = bytearray(frame_bytes(encode_anchor(NEW, version=3, config=CONFIG)))
    anchor2[len(anchor2) // 2] ^= 0x10
    assert_refused(chain, bytes(anchor2), CorruptFrameError)


def test_tensor_dtype_matters_not_just_bits():
    chain = fresh_chain()
    as_f16 = {k: v.view(torch.float16) if v.dtype == torch.bfloat16 else v for k, v in BASE.items()}
    frame = frame_bytes(encode_delta(as_f16, as_f16, base_version=0, version=1, config=CONFIG))
    assert_refused(chain, frame, (LayoutMismatchError, BaseMismatchError))
