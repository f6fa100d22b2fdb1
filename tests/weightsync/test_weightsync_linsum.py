"""The ls128 tensor sum that follows the change (``codec.linsum``), and the ``S`` record that
carries a delta's new sums: the moved sum equals the full one, for every word size, length,
slicing and device path; a delta verified by moved sums refuses what the full check refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.weightsync import (
    ChecksumMismatchError,
    CodecConfig,
    CorruptFrameError,
    TruncatedFrameError,
    VersionChain,
    apply_frame,
    encode_anchor,
    encode_delta,
    frame_bytes,
)
from modal_rl.weightsync.codec import linsum
from modal_rl.weightsync.codec.differ import NumpyDiffer, TorchDiffer
from modal_rl.weightsync.codec.diffwords import diff_words
from modal_rl.weightsync.wire.frames import TAG_SUMS
from tests.weightsync_helpers import clone_state, model_state, perturb, records, same_state

WORDS = [np.uint8, np.uint16, np.uint32, np.uint64]
CONFIG = CodecConfig(chunk_elems=2048, threads=2)


def _words(dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)


def _change(words: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(words after, sorted positions, old words there) with ``k`` words changed."""
    rng = np.random.default_rng(seed + 1)
    positions = np.sort(rng.choice(words.size, min(k, words.size), replace=False)).astype(np.int64)
    after = words.copy()
    after[positions] ^= np.asarray(rng.integers(1, 255, positions.size), dtype=words.dtype)
    return after, positions, words[positions].copy()


@settings(max_examples=60, deadline=None)
@given(word=st.sampled_from(WORDS), n=st.integers(0, 70), k=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_a_moved_sum_equals_the_full_sum_for_every_word_size_and_length(word, n, k, seed):
    before = _words(word, n, seed)
    after, positions, old = _change(before, k, seed)
    moved = linsum.add_sums(linsum.full_sum(before), linsum.delta_sum(after, positions, old))
    assert moved == linsum.full_sum(after)
    assert (moved == linsum.full_sum(before)) == (positions.size == 0)


def test_the_numpy_path_gives_the_compiled_paths_sums(monkeypatch):
    before = _words(np.uint16, 1001, 3)
    after, positions, old = _change(before, 40, 3)
    compiled = linsum.full_sum(after), linsum.delta_sum(after, positions, old)
    monkeypatch.setattr(linsum, "_compiled", lambda: None)
    assert (linsum.full_sum(after), linsum.delta_sum(after, positions, old)) == compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float64])
def test_device_sums_in_slices_and_from_gathered_blocks_equal_the_host_ones(dtype):
    # TorchDiffer sums a device tensor slice by slice and moves a sum from gathered blocks
    # only; on CPU tensors here, with slices far smaller than the tensor.
    gen = torch.Generator().manual_seed(5)
    size = torch.empty((), dtype=dtype).element_size()
    tensor = torch.randint(0, 255, (1003 * size,), generator=gen, dtype=torch.uint8).view(
        dtype
    )  # a tail block
    host, device = NumpyDiffer(), TorchDiffer()
    h, d = host.prepare(tensor), device.prepare(tensor)
    assert device.checksum(d, copy_elems=64) == host.checksum(h)
    positions = np.array([0, 3, 9, 10, h.size - 1], np.int64)
    old = h[positions] ^ np.asarray(1, h.dtype)
    assert device.delta_sum(d, positions, old) == host.delta_sum(h, positions, old)


def test_every_single_bit_flip_and_every_block_swap_changes_the_sum():
    words = _words(np.uint16, 96, 9)
    base = linsum.full_sum(words)
    flipped = {
        linsum.full_sum(np.where(np.arange(96) == i, words ^ np.uint16(1 << b), words))
        for i in range(96)
        for b in (0, 7, 15)
    }
    assert base not in flipped and len(flipped) == 96 * 3
    swapped = words.reshape(-1, 4)[[1, 0] + list(range(2, 24))].reshape(-1)  # two blocks trade places
    assert linsum.full_sum(swapped) != base


def test_reapplying_an_xor_delta_with_stale_sums_is_refused():
    # The receiver already holds the delta's result but still keeps the base's sums: an XOR
    # delta applied again takes it back to the base. An XOR-combined sum would move by the
    # same amount both ways and pass; ls128 adds, so the moved sum misses the sent one.
    config = CodecConfig(chunk_elems=2048, threads=2, coding=1)
    base, new = model_state(), perturb(model_state(), 0.05, seed=2)
    base_sums: dict[str, str] = {}
    frame_bytes(encode_anchor(base, version=0, config=config, checksums_out=base_sums))
    delta = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=config))
    held = clone_state(new)
    with pytest.raises(ChecksumMismatchError):
        apply_frame(
            held, io.BytesIO(delta), held_version=0, held_checksums=base_sums, config=config, key=None
        )
    assert same_state(held, new)


def _chain_at_base():
    base = model_state()
    chain = VersionChain(CONFIG, key=None)
    chain.apply(frame_bytes(encode_anchor(base, version=0, config=CONFIG)))
    return chain, base


def test_a_delta_without_its_sums_record_is_refused_and_changes_nothing():
    chain, base = _chain_at_base()
    delta = frame_bytes(
        encode_delta(base, perturb(base, 0.05, seed=4), base_version=0, version=1, config=CONFIG)
    )
    ((at, size, _),) = [r for r in records(delta) if r[2] == TAG_SUMS]
    with pytest.raises((CorruptFrameError, TruncatedFrameError)):
        chain.apply(delta[:at] + delta[at + size :])
    assert chain.version == 0 and same_state(chain.state, base)


def test_an_anchor_with_a_sums_record_is_refused():
    chain, base = _chain_at_base()
    delta = frame_bytes(
        encode_delta(base, perturb(base, 0.05, seed=4), base_version=0, version=1, config=CONFIG)
    )
    ((at, size, _),) = [r for r in records(delta) if r[2] == TAG_SUMS]
    anchor = frame_bytes(encode_anchor(perturb(base, 0.05, seed=4), version=2, config=CONFIG))
    end = records(anchor)[-1][0]
    with pytest.raises(CorruptFrameError, match="sums record"):
        chain.apply(anchor[:end] + delta[at : at + size] + anchor[end:])
    assert chain.version == 0 and same_state(chain.state, base)


def test_the_publishers_kept_sums_are_the_full_sums_of_its_snapshot():
    # The sums a delta reports (checksums_out, the next delta's base sums) were moved, not
    # recomputed: they must be exactly what a full pass over the new state gives.
    base, new = model_state(), perturb(model_state(), 0.05, seed=6)
    moved: dict[str, str] = {}
    frame_bytes(encode_delta(base, new, base_version=0, version=1, config=CONFIG, checksums_out=moved))
    full = {name: NumpyDiffer().checksum(NumpyDiffer().prepare(t)) for name, t in new.items()}
    assert moved == full


@settings(max_examples=40, deadline=None)
@given(
    word=st.sampled_from(WORDS),
    n=st.integers(0, 300),
    k=st.integers(0, 40),
    chunk=st.sampled_from([8, 64]),
    seed=st.integers(0, 2**16),
)
def test_the_fused_diff_moves_the_sum_as_a_separate_pass_does(word, n, k, chunk, seed):
    # The publisher's diff of a chunk (starting at a block boundary of its tensor) also
    # moves the tensor's sum; it must equal the diff plus a separate delta_sum.
    base = _words(word, n, seed)
    new, _, _ = _change(base, k, seed)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        positions, old, words, move = NumpyDiffer().diff_moved(base, new, start, end - start)
        expected = diff_words(base[start:end], new[start:end])
        assert all(np.array_equal(a, b) for a, b in zip((positions, old, words), expected, strict=True))
        assert move == linsum.delta_sum(new, positions + start, old)
