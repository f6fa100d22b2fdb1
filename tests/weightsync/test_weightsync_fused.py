"""The fused chunk kernel against the per-piece diff and sum it replaces."""

import numpy as np
import pytest

from modal_rl.weightsync.codec import fused, linsum
from modal_rl.weightsync.codec.diffwords import diff_words, join_diffs


def _pieces(rng, dtype, sizes, density, first_at=0):
    out, start = [], 0
    for i, size in enumerate(sizes):
        at = first_at if i == 0 else 0
        b = rng.integers(0, np.iinfo(dtype).max, at + size, dtype=dtype, endpoint=True)
        n = b.copy()
        hit = rng.random(at + size) < density
        n[hit] ^= dtype(1 + (rng.integers(0, 3)))
        out.append((b, n, at, size, start))
        start += size
    return out, start


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("sizes", [[1], [7, 9], [64, 3, 4099], [0, 8, 1000, 17], [257 * 8]])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("write", [False, True])
def test_matches_the_per_piece_diff_and_sums(dtype, sizes, density, write):
    rng = np.random.default_rng(sum(sizes))
    pieces, total = _pieces(rng, dtype, sizes, density, first_at=64 if len(sizes) == 1 else 0)
    before = [(b.copy(), n.copy()) for b, n, *_ in pieces]
    want = join_diffs(
        [diff_words(b[at : at + c], n[at : at + c]) for b, n, at, c, _ in pieces],
        [s for *_, s in pieces],
    )
    want_moves = []
    for _b, n, at, c, s in pieces:
        sel = (want[0] >= s) & (want[0] < s + c)
        want_moves.append(linsum.delta_sum(n, want[0][sel] - s + at, want[1][sel]))
    got = fused.diff_chunk(pieces, total, write)
    assert got is not None
    for g, w in zip(got[:3], want, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    assert [fused.lanes_hex(a, c) for a, c in zip(got[3], got[4], strict=True)] == want_moves
    for (b, n, at, c, _), (b0, n0) in zip(pieces, before, strict=True):
        assert np.array_equal(n, n0)  # the new words are only read
        expect = b0.copy()
        if write:
            expect[at : at + c] = n0[at : at + c]
        assert np.array_equal(b, expect)
    for (_b, n, at, c, _), (b0, n0), move in zip(pieces, before, want_moves, strict=True):
        if at == 0 and c == n.size:  # a whole tensor: the move takes its base's sum to the new one's
            assert linsum.add_sums(linsum.full_sum(b0), move) == linsum.full_sum(n0)


def test_a_piece_off_a_block_boundary_or_strided_takes_the_numpy_path():
    b = np.zeros(64, np.uint16)
    n = b.copy()
    assert fused.diff_chunk([(b, n, 3, 8, 0)], 8, True) is None
    assert fused.diff_chunk([(b[::2], n[::2], 0, 8, 0)], 8, True) is None


def test_write_changed_puts_the_changes_into_the_pieces():
    rng = np.random.default_rng(3)
    pieces, total = _pieces(rng, np.uint16, [40, 8, 129], 0.2)
    got = fused.diff_chunk(pieces, total, False)
    fused.write_changed(pieces, got[0], got[2])
    for b, n, at, c, _ in pieces:
        assert np.array_equal(b[at : at + c], n[at : at + c])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("xor", [True, False])
def test_apply_sparse_matches_scatter_and_its_moves(dtype, xor):
    from modal_rl.weightsync.codec.chunk_sums import chunk_moves
    from modal_rl.weightsync.codec.codings.chunks import SUB_SPARSE, XOR_SPARSE, DecodedChunk

    rng = np.random.default_rng(7)
    sizes = [13, 200, 9, 1030]  # a group's tensors; the chunk covers words 8..1200 of them
    held = [rng.integers(0, np.iinfo(dtype).max, s, dtype=dtype, endpoint=True) for s in sizes]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    lo, count = 8, 1200
    positions = np.sort(rng.choice(count, 150, replace=False)).astype(np.int64)
    values = rng.integers(1, np.iinfo(dtype).max, 150, dtype=dtype, endpoint=True)
    encoding = XOR_SPARSE if xor else SUB_SPARSE
    chunk = DecodedChunk(1, lo, count, 150, encoding, positions, values)
    want = [h.copy() for h in held]
    want_segments = list(zip(offsets, want, strict=True))
    chunk.apply(want_segments)
    want_moves = chunk_moves(chunk, want_segments)
    segments = list(zip(offsets, held, strict=True))
    got_moves = fused.apply_sparse(segments, lo, positions, values, xor)
    assert all(np.array_equal(g, w) for g, w in zip(held, want, strict=True))
    assert got_moves == [(k, m) for k, m in want_moves if m != linsum.EMPTY]


def test_apply_sparse_leaves_a_position_past_the_tensors_to_the_checked_path():
    words = np.zeros(16, np.uint16)
    assert fused.apply_sparse([(0, words)], 8, np.array([9], np.int64), np.ones(1, np.uint16), True) is None
    assert not words.any()
