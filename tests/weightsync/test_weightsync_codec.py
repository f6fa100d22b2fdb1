"""Round trips of the codec: every dtype, odd shapes, densities 0–100%, numpy vs torch path."""

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
    LayoutMismatchError,
    NumpyDiffer,
    TorchDiffer,
    VersionChain,
    WeightSyncError,
    apply_frame,
    encode_anchor,
    encode_delta,
    frame_bytes,
)
from modal_rl.weightsync.codec.codings.chunks import DENSE, SPARSE, decode_chunk
from modal_rl.weightsync.codec.differ import checksum_words
from modal_rl.weightsync.codec.dtypes import words_of
from tests.weightsync_helpers import DTYPES, clone_state, model_state, perturb, random_tensor, same_state

SMALL = CodecConfig(chunk_elems=4096, threads=2)


def roundtrip(base, new, config=SMALL):
    chain = VersionChain(config, key=None)
    chain.apply(encode_anchor(base, version=0, config=config))
    assert same_state(chain.state, base)
    delta = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=config))
    chain.apply(delta)
    return chain, delta


shapes = st.lists(st.integers(0, 29), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shapes=st.lists(shapes, min_size=1, max_size=4),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    chunk_elems=st.sampled_from([8, 24, 256, 4096]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_is_bit_exact(dtype, shapes, density, chunk_elems, seed):
    gen = torch.Generator().manual_seed(seed)
    base = {f"t{i}": random_tensor(s, dtype, gen) for i, s in enumerate(shapes)}
    new = perturb(base, density, seed)
    chain, _ = roundtrip(base, new, CodecConfig(chunk_elems=chunk_elems, threads=2))
    assert same_state(chain.state, new)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shapes=st.lists(shapes, min_size=1, max_size=4),
    density=st.sampled_from([0.0, 0.001, 0.05, 1.0]),
    chunk_elems=st.sampled_from([8, 24, 256, 4096]),
    coding=st.sampled_from([0, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_update_base_leaves_the_base_equal_to_new_and_the_frame_unchanged(
    dtype, shapes, density, chunk_elems, coding, seed
):
    """``update_base`` (the publisher's one-copy snapshot) writes new into the base while
    coding; the frame is byte for byte the one coded without it, for every coding."""
    gen = torch.Generator().manual_seed(seed)
    base = {f"t{i}": random_tensor(s, dtype, gen) for i, s in enumerate(shapes)}
    new = perturb(base, density, seed)
    config = CodecConfig(chunk_elems=chunk_elems, threads=2, coding=coding)
    plain = frame_bytes(encode_delta(clone_state(base), new, base_version=0, version=1, config=config))
    held = clone_state(base)
    updated = frame_bytes(encode_delta(held, new, base_version=0, version=1, config=config, update_base=True))
    assert updated == plain
    assert same_state(held, new)


@pytest.mark.parametrize("dtype", DTYPES)
def test_smallest_chunks(dtype):
    gen = torch.Generator().manual_seed(3)
    base = {"a": random_tensor((5, 3), dtype, gen), "b": random_tensor((), dtype, gen)}
    new = perturb(base, 0.5, seed=3)
    chain, _ = roundtrip(base, new, CodecConfig(chunk_elems=8, threads=2))
    assert same_state(chain.state, new)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_density_changes_every_word(dtype):
    gen = torch.Generator().manual_seed(1)
    base = {"w": random_tensor((300, 17), dtype, gen)}
    new = {"w": (base["w"].reshape(-1).view(torch.uint8) ^ 0xFF).view(dtype).reshape(300, 17)}
    chain, delta = roundtrip(base, new)
    assert same_state(chain.state, new)
    assert chain.version == 1


def test_unchanged_state_makes_a_tiny_delta():
    base = model_state()
    chain, delta = roundtrip(base, clone_state(base))
    assert same_state(chain.state, base)
    raw = sum(t.numel() * t.element_size() for t in base.values())
    assert len(delta) < 0.02 * raw  # headers only: no word changed


def test_sparse_and_dense_chunks_are_chosen_by_density():
    gen = torch.Generator().manual_seed(2)
    base = {"w": random_tensor((8192,), torch.bfloat16, gen)}
    encodings = {}
    for density in (0.01, 0.9):
        delta = frame_bytes(
            encode_delta(base, perturb(base, density), base_version=0, version=1, config=SMALL)
        )
        from tests.weightsync_helpers import records

        chunk_bodies = [delta[o + 5 : o + s - 8] for o, s, tag in records(delta) if tag == b"C"]
        encodings[density] = {decode_chunk(b, 2, SMALL.chunk_elems).encoding for b in chunk_bodies}
    assert encodings[0.01] <= SPARSE and len(encodings[0.01]) == 1
    assert encodings[0.9] <= DENSE and len(encodings[0.9]) == 1


def test_torch_path_writes_the_same_bytes_as_numpy():
    base = model_state()
    new = perturb(base, 0.03)
    numpy_frame = frame_bytes(
        encode_delta(base, new, base_version=0, version=1, config=SMALL, differ=NumpyDiffer())
    )
    torch_frame = frame_bytes(
        encode_delta(base, new, base_version=0, version=1, config=SMALL, differ=TorchDiffer())
    )
    assert numpy_frame == torch_frame
    anchor_np = frame_bytes(encode_anchor(new, version=0, config=SMALL, differ=NumpyDiffer()))
    anchor_torch = frame_bytes(encode_anchor(new, version=0, config=SMALL, differ=TorchDiffer()))
    assert anchor_np == anchor_torch


def test_threads_and_chunking_do_not_change_the_result():
    base = model_state()
    new = perturb(base, 0.02)
    one = frame_bytes(
        encode_delta(base, new, base_version=0, version=1, config=CodecConfig(chunk_elems=512, threads=1))
    )
    many = frame_bytes(
        encode_delta(
            base, new, base_version=0, version=1, config=CodecConfig(chunk_elems=512, threads=4, window=3)
        )
    )
    assert one == many


def test_delta_is_applied_in_place_on_the_held_tensors():
    base = model_state()
    new = perturb(base, 0.05)
    held = clone_state(base)
    storage = {k: v.data_ptr() for k, v in held.items() if v.numel()}
    delta = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=SMALL))
    apply_frame(held, io.BytesIO(delta), held_version=0, config=SMALL, key=None)
    assert same_state(held, new)
    assert {k: v.data_ptr() for k, v in held.items() if v.numel()} == storage


def test_layout_mismatch_is_refused_before_encoding():
    base = model_state()
    new = clone_state(base)
    new["layer.0.q.bias"] = torch.zeros(65, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatchError, match="layer.0.q.bias"):
        encode_delta(base, new, base_version=0, version=1)
    with pytest.raises(LayoutMismatchError, match="only in"):
        encode_delta(base, {**new, "extra": torch.zeros(1)}, base_version=0, version=1)


def test_checksums_out_match_the_new_state():
    base, new = model_state(), perturb(model_state(), 0.1)
    sums: dict[str, str] = {}
    frame_bytes(encode_delta(base, new, base_version=0, version=1, config=SMALL, checksums_out=sums))
    d = NumpyDiffer()
    assert sums == {k: d.checksum(d.prepare(v)) for k, v in new.items()}


def test_numpy_arrays_are_accepted():
    rng = np.random.default_rng(0)
    base = {"a": rng.standard_normal((50, 3)).astype(np.float32)}
    new = {"a": base["a"].copy()}
    new["a"][3, 1] += 1.0
    delta = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=SMALL))
    held = {"a": base["a"].copy()}
    apply_frame(held, io.BytesIO(delta), held_version=0, config=SMALL, key=None)
    assert np.array_equal(held["a"].view(np.uint32), new["a"].view(np.uint32))


def test_codec_config_is_validated():
    with pytest.raises(ValueError, match="chunk_elems"):
        CodecConfig(chunk_elems=0)
    with pytest.raises(ValueError, match="never splits a checksum block"):
        CodecConfig(chunk_elems=12)
    with pytest.raises(ValueError, match="threads"):
        CodecConfig(threads=0)


@pytest.mark.parametrize("fmt", [1, 2])
def test_device_apply_path_scatters_with_torch_and_rolls_back(monkeypatch, fmt):
    # The device path (torch integer views, host-decoded chunks uploaded and scattered by
    # torch) runs on CPU tensors here; on a GPU the same code writes device memory.
    import modal_rl.weightsync.codec.decode as decode

    monkeypatch.setattr(decode, "_words", lambda t: TorchDiffer().prepare(t))
    config = CodecConfig(chunk_elems=4096, threads=2, coding=fmt)
    base, new = model_state(), perturb(model_state(), 0.05)
    delta = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=config))
    held = clone_state(base)
    apply_frame(held, io.BytesIO(delta), held_version=0, config=config, key=None)
    assert same_state(held, new)
    # Applying it again is refused up front: each group header names its base's sums.
    with pytest.raises(BaseMismatchError):
        apply_frame(held, io.BytesIO(delta), held_version=0, config=config, key=None)
    # A receiver that wrongly believes it holds the base: v1 finds out only from the sums its
    # chunks moved, after the scatter, so the rollback must restore every word through the
    # same torch path; v2 chunks are modelled on the held words and mostly fail to decode.
    base_sums = {name: checksum_words(words_of(t)) for name, t in base.items()}
    with pytest.raises(ChecksumMismatchError if fmt == 1 else WeightSyncError):
        apply_frame(
            held, io.BytesIO(delta), held_version=0, held_checksums=base_sums, config=config, key=None
        )
    assert same_state(held, new)


def test_an_iterator_of_named_tensors_encodes_like_a_mapping():
    base, new = model_state(), perturb(model_state(), 0.03)
    from_map = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=SMALL))
    from_iter = frame_bytes(
        encode_delta(base, iter(list(new.items())), base_version=0, version=1, config=SMALL)
    )
    assert from_map == from_iter
    short = iter(list(new.items())[:-1])
    with pytest.raises(LayoutMismatchError, match="lacks"):
        frame_bytes(encode_delta(base, short, base_version=0, version=1, config=SMALL))


def test_the_compiled_scatter_wraps_like_the_words_and_refuses_out_of_range_changes():
    from modal_rl.weightsync.codec.scatter import scatter

    words = np.array([0xFFFF, 1, 2, 3, 0x8000], dtype=np.uint16)
    scatter(words, np.array([10, 12, 14]), 10, np.array([1, 5, 0x8000], np.uint16), "add")
    assert words.tolist() == [0, 1, 7, 3, 0]  # wrapping u16 arithmetic
    scatter(words, np.array([1, 3]), 0, np.array([3, 3], np.uint16), "xor")
    assert words.tolist() == [0, 2, 7, 0, 0]
    before = words.copy()
    with pytest.raises(IndexError):
        scatter(words, np.array([2, 5]), 0, np.array([9, 9], np.uint16), "set")
    assert (words == before).all()


def test_literal_tuned_zstd_is_written_as_plain_zstd_and_reads_back():
    # ZSTD_LITERALS is an encoder's choice: readers only ever see the ZSTD method.
    from modal_rl.weightsync.codec.streams import (
        ZSTD,
        ZSTD_LITERALS,
        _read_varint,
        pack_streams,
        unpack_streams,
    )

    rng = np.random.default_rng(5)
    exponents = (118 + np.clip(rng.normal(0, 2, 1 << 16), -10, 10)).astype(np.uint8)
    body = pack_streams([exponents], [ZSTD_LITERALS], 1)
    method, _ = _read_varint(memoryview(body), 0)
    assert method == ZSTD and len(body) < exponents.size // 2
    (raw,) = unpack_streams(memoryview(body), 0, 1, exponents.size)
    assert bytes(raw) == exponents.tobytes()


def test_concurrent_encodes_and_applies_share_the_workers_and_stay_exact():
    # Encode and apply in several threads at once run their tasks on one shared pool;
    # none waits on another's tasks, and every result is exact.
    from concurrent.futures import ThreadPoolExecutor

    pairs = [(model_state(), None) for _ in range(4)]
    pairs = [(base, perturb(base, 0.02 * (k + 1))) for k, (base, _) in enumerate(pairs)]

    def round_trip(pair):
        base, new = pair
        delta = frame_bytes(encode_delta(base, new, base_version=0, version=1, config=SMALL))
        held = clone_state(base)
        apply_frame(held, io.BytesIO(delta), held_version=0, config=SMALL, key=None)
        return same_state(held, new)

    with ThreadPoolExecutor(max_workers=4) as callers:
        assert all(callers.map(round_trip, pairs * 2))


def test_a_forked_process_gets_pools_of_its_own(monkeypatch):
    # Threads do not survive a fork: a child must not queue work on its parent's pool.
    import os

    from modal_rl.weightsync.codec import workers

    parent = workers.shared_pool(3)
    assert workers.shared_pool(3) is parent
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as in a forked child
    child = workers.shared_pool(3)
    try:
        assert child is not parent and child.submit(sum, [1, 2]).result(timeout=10) == 3
    finally:
        child.shutdown()
        del workers._pools[(-1, 3)]
