"""The compiled v1 coder (same bytes as the numpy one) and anchors applied in place over a
held state, with an undo log that restores it exactly when the anchor is refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modal_rl.weightsync import (
    CodecConfig,
    VersionChain,
    WeightSyncError,
    encode_anchor,
    encode_delta,
    frame_bytes,
)
from modal_rl.weightsync.codec import anchor_inplace, decode
from modal_rl.weightsync.codec.codings import chunks, sparse_coder
from modal_rl.weightsync.wire.auth import frame_keys, sign_records
from modal_rl.weightsync.wire.frames import split_records, stamp
from tests.weightsync_helpers import TEST_KEY, clone_state, model_state, perturb, records, reseal, same_state

CONFIG = CodecConfig(chunk_elems=1 << 12, threads=2)


def numpy_coded(spec, positions, old, new) -> bytes:
    compiled = chunks._compiled_coder
    chunks._compiled_coder = lambda o, n: None
    try:
        return chunks.encode_delta_chunk(spec, positions, old, new, 1)
    finally:
        chunks._compiled_coder = compiled


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    count=st.integers(1, 1 << 18),
    density=st.sampled_from([1e-4, 1e-3, 0.01, 0.1, 0.3]),
    ulps=st.sampled_from([0, 3, 300]),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_coder_writes_the_numpy_coder_s_bytes(itemsize, count, density, ulps, seed):
    # ulps 0: unrelated words (XOR wins); small steps: SUB wins; sparse chunks: gap escapes
    assert sparse_coder.available()
    rng = np.random.default_rng(seed)
    word = np.dtype(f"<u{itemsize}")
    k = max(1, int(count * density))
    positions = np.sort(rng.choice(count, min(k, count), replace=False)).astype(np.int64)
    old = rng.integers(0, np.iinfo(word).max, positions.size, dtype=word, endpoint=True)
    if ulps:
        new = old + rng.integers(1, ulps + 1, positions.size).astype(word)
    else:
        new = rng.integers(0, np.iinfo(word).max, positions.size, dtype=word, endpoint=True)
    spec = chunks.ChunkSpec(3, 3 * count, count)
    assert chunks.encode_delta_chunk(spec, positions, old, new, 1) == numpy_coded(spec, positions, old, new)


@given(n=st.integers(1, 1 << 28))
def test_a_strided_sample_s_counts_stay_inside_the_residual_choice_s_table(n):
    # the compiled choice reads c·log2(c) from a table: no count may fall past its end
    step = max(1, n // sparse_coder.SAMPLE)
    assert -(-n // step) < sparse_coder.clogc_table(sparse_coder.SAMPLE).size


def test_the_compiled_choice_is_the_numpy_rule_on_the_same_counts():
    rng = np.random.default_rng(5)
    for _ in range(50):
        hist = rng.integers(0, 40, (2, 2, 4, 256)) * (rng.random((2, 2, 4, 256)) < 0.2)
        table = sparse_coder.clogc_table(sparse_coder.SAMPLE)
        assert sparse_coder.CHOOSE.get()(hist, table) == sparse_coder.choose_kind(hist.sum(axis=2))
    ties = np.zeros((2, 2, 4, 256), np.int64)
    ties[:, :, 0, 7] = 3  # equal sums: XOR, as before
    assert sparse_coder.CHOOSE.get()(ties, table) == 0 == sparse_coder.choose_kind(ties.sum(axis=2))


def test_gaps_past_every_escape_width_code_the_same_bytes():
    positions = np.array([0, 254, 255 + 254, 1 << 17, (1 << 17) + 1, (1 << 26) - 1], np.int64)
    old = np.arange(positions.size, dtype=np.uint16)
    new = old ^ np.uint16(0x8001)
    spec = chunks.ChunkSpec(0, 0, 1 << 26)
    body = chunks.encode_delta_chunk(spec, positions, old, new, 1)
    assert body == numpy_coded(spec, positions, old, new)
    decoded = chunks.decode_chunk(body, 2, 1 << 26)
    assert (decoded.positions == positions).all()


# An anchor that arrives over a held state: several groups and chunks, a new tensor, a
# reshaped one, and a held tensor the anchor no longer names.
HELD = model_state(seed=1)
NEXT = perturb(perturb(HELD, 0.02, seed=2), 0.02, seed=3)
NEXT["extra.bias"] = torch.randn(300).to(torch.bfloat16)
RESHAPED = next(name for name, t in HELD.items() if t.dim() == 2)
NEXT[RESHAPED] = NEXT[RESHAPED].reshape(-1).clone()
DROPPED = next(name for name in HELD if name != RESHAPED and HELD[name].numel() > 64)
del NEXT[DROPPED]


NEXT_DELTA = perturb(HELD, 0.01, seed=9)


def signed(frame) -> bytes:
    return frame_bytes(sign_records(frame, frame_keys(TEST_KEY)))


def anchor_frame() -> bytes:
    return signed(encode_anchor(NEXT, version=4, config=CONFIG))


def held_chain() -> VersionChain:
    """A receiver holding version 1 (an anchor, then a delta)."""
    chain = VersionChain(CONFIG, retain=False, key=TEST_KEY)
    chain.apply(signed(encode_anchor(HELD, version=0, config=CONFIG)))
    chain.apply(signed(encode_delta(HELD, NEXT_DELTA, base_version=0, version=1, config=CONFIG)))
    return chain


def test_an_anchor_over_a_held_state_is_written_into_the_held_tensors():
    chain = held_chain()
    held = dict(chain.state)
    chain.apply(anchor_frame())
    assert chain.version == 4 and same_state(chain.state, NEXT)
    kept = [n for n in NEXT if n in held and n != RESHAPED]
    assert kept and all(chain.state[n] is held[n] for n in kept)  # the same memory, no second copy
    assert chain.state[RESHAPED] is not held[RESHAPED] and DROPPED not in chain.state
    chain.apply(
        signed(encode_delta(NEXT, perturb(NEXT, 0.01, seed=5), base_version=4, version=5, config=CONFIG))
    )
    assert same_state(chain.state, perturb(NEXT, 0.01, seed=5))


def assert_refused_unchanged(frame: bytes) -> None:
    chain = held_chain()
    before = clone_state(chain.state)
    with pytest.raises(WeightSyncError):
        chain.apply(frame)
    assert chain.version == 1 and same_state(chain.state, before)
    chain.apply(anchor_frame())  # and the chain still takes the anchor whole
    assert same_state(chain.state, NEXT)


def test_an_anchor_cut_at_any_record_boundary_leaves_the_held_state_exactly():
    frame = anchor_frame()
    cuts = [offset for offset, _, _ in records(frame)][1:]
    assert sum(1 for *_, tag in records(frame) if tag == b"C") > 10
    for cut in cuts:
        assert_refused_unchanged(frame[:cut])


def test_an_anchor_with_a_damaged_record_leaves_the_held_state_exactly():
    frame = anchor_frame()
    chunk_records = [(o, s) for o, s, tag in records(frame) if tag == b"C"]
    offset, size = chunk_records[-2]  # late: most chunks are already written in place
    damaged = bytearray(frame)
    damaged[offset + size // 2] ^= 0x10  # the record's MAC no longer holds
    assert_refused_unchanged(bytes(damaged))


def test_an_anchor_whose_last_tensor_fails_its_sum_rolls_back_every_write():
    # The damage is resealed (its record digest recomputed; without the key its MAC is not),
    # so an unsigned frame lets it reach the sums: every chunk before it was written.
    chain = VersionChain(CONFIG, retain=False, key=None)
    chain.apply(encode_anchor(HELD, version=0, config=CONFIG))
    before = clone_state(chain.state)
    frame = frame_bytes(encode_anchor(NEXT, version=4, config=CONFIG))
    offset, size = [(o, s) for o, s, tag in records(frame) if tag == b"C"][-1]
    body = bytearray(frame[offset + 5 : offset + size - 8])
    body[-1] ^= 0x01  # a stored byte plane's last byte: decodes, but to another word
    with pytest.raises(WeightSyncError):
        chain.apply(reseal(frame, offset, bytes(body)))
    assert chain.version == 0 and same_state(chain.state, before)


@pytest.mark.parametrize("window", [64, 1000])
def test_an_in_place_chunk_compared_in_windows_logs_exactly_its_difference(monkeypatch, window):
    # windows that split tensors and chunks at unaligned places: the undo body is the
    # chunk-local difference, the writes are the anchor's words, the fresh member takes all
    monkeypatch.setattr(anchor_inplace, "WINDOW_WORDS", window)
    rng = np.random.default_rng(7)
    sizes = [3000, 70, 5000]
    held = [rng.integers(0, 1 << 16, n, dtype=np.uint16) for n in sizes]
    before = [h.copy() for h in held]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    anchor = np.concatenate(held)
    anchor[rng.random(anchor.size) < 0.05] += np.uint16(3)
    lo, count = 1024, 6000  # chunk 1 of 1024-word chunks, over all three members
    chunk = chunks.DecodedChunk(1, lo, count, count, chunks.FULL, None, anchor[lo : lo + count].copy())
    logged: list[bytes] = []
    segments = list(zip(starts, held, strict=True))
    anchor_inplace.apply_full_chunk(segments, [True, False, True], chunk, logged.append)
    for start, words, old in zip(starts, held, before, strict=True):
        a, b = max(lo, start), min(lo + count, start + words.size)
        expected = old.copy()
        expected[a - start : b - start] = anchor[a:b]
        assert (words == expected).all()
    assert len(logged) == 1
    undo = chunks.decode_chunk(logged[0], 2, 1024)
    changed = (np.concatenate(before) != anchor)[lo : lo + count]
    changed[starts[1] - lo : starts[2] - lo] = False  # the fresh member is not logged
    assert undo.nchanged == int(changed.sum()) and (undo.positions == np.flatnonzero(changed)).all()
    in_place_segments = [(s, w) for s, w, keep in zip(starts, held, [True, False, True], strict=True) if keep]
    undo.apply(in_place_segments, undo=True)
    assert (held[0] == before[0]).all() and (held[2] == before[2]).all()


def test_an_anchor_compared_in_small_windows_is_written_and_rolled_back_exactly(monkeypatch):
    monkeypatch.setattr(anchor_inplace, "WINDOW_WORDS", 100)  # many windows per 4096-word chunk
    test_an_anchor_over_a_held_state_is_written_into_the_held_tensors()
    test_an_anchor_with_a_damaged_record_leaves_the_held_state_exactly()


RUN, OLD_EPOCH, HELD_EPOCH = "test-run", 0x5CA1E, 0x5CA1F


def stamped(frame, epoch: int) -> bytes:
    return signed(stamp(frame, RUN, epoch))


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("refusal", ["older epoch", "below the floor"])
def test_an_anchor_of_a_refused_epoch_is_refused_before_any_write(monkeypatch, streamed, refusal):
    chain = VersionChain(CONFIG, retain=False, key=TEST_KEY)
    chain.apply(stamped(encode_anchor(HELD, version=0, config=CONFIG), HELD_EPOCH))
    chain.apply(stamped(encode_delta(HELD, NEXT_DELTA, base_version=0, version=1, config=CONFIG), HELD_EPOCH))
    anchor_epoch = OLD_EPOCH  # an older trainer's anchor
    if refusal == "below the floor":  # a pull told the receiver a newer epoch is current
        chain.floor_epoch, anchor_epoch = HELD_EPOCH + 1, HELD_EPOCH
    held = dict(chain.state)
    before = clone_state(chain.state)
    touched: list[str] = []
    for module, name in ((anchor_inplace, "apply_full_chunk"), (decode, "decode_chunk")):
        original = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _o=original, _n=name, **k: touched.append(_n) or _o(*a, **k)
        )
    frame = stamped(encode_anchor(NEXT, version=4, config=CONFIG), anchor_epoch)
    with pytest.raises(WeightSyncError) as refused:
        if streamed:
            chain.apply_records(split_records(io.BytesIO(frame)))
        else:
            chain.apply(frame)
    message = str(refused.value)
    assert "\n" not in message and f"{anchor_epoch:x}" in message, message
    assert touched == []  # refused on its version header: no chunk decoded, no word written
    assert chain.version == 1 and chain.epoch == HELD_EPOCH and same_state(chain.state, before)
    assert all(chain.state[n] is held[n] for n in held)
