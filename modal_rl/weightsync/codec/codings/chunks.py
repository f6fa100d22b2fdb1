"""Chunk bodies: how one chunk of a group's word space is laid out on the wire.

Chunk ``index`` of a group covers ``elem_count`` words starting at ``index × chunk_elems``.
Its body is a fixed header followed by ``nstreams`` streams (see ``streams``). Encodings:

- ``UNCHANGED``: no word differs; no streams.
- ``*_SPARSE``: positions as gaps (``gap = pos[i] - pos[i-1] - 1``, ``pos[-1] = -1``),
  escape-coded (one byte ``min(gap, 255)``; gaps >= 255 also put ``gap - 255`` as a u32
  into four byte-plane exception streams), then the changed words' residuals, split into
  byte planes (plane k = byte k of each little-endian word).
- ``*_DENSE``: the residual of every word, byte-split; cheaper than gaps when most change.
- ``FULL``: the new words themselves, byte-split (anchors).

Two residuals, picked per chunk by the smaller order-0 entropy of their planes:

- ``XOR``: ``base ^ new``. An involution, so applying it twice restores the base.
- ``SUB``: ``zigzag(new - base)`` in wrapping word arithmetic. For floats of one sign the
  bit pattern is monotonic in the value, so a small update is a small integer: a 1-ulp
  step is 1 or 2, where its XOR is a carry run (1, 3, 7, 15, …). Undone by subtracting.

Invariant: a malformed body raises ``CorruptFrameError`` and leaves the target words as
they were. v1 bodies are validated before anything is written; v2 bodies are decoded into
the held host words (``host_written``), which are put back when the streams fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from modal_rl.weightsync.codec.diffwords import diff_words, join_diffs
from modal_rl.weightsync.codec.scatter import scatter, update
from modal_rl.weightsync.codec.streams import (
    RANS0,
    STORED,
    ZSTD,
    ZSTD_LITERALS,
    byte_planes,
    join_planes,
    pack_streams,
    pick_coder,
    unpack_streams,
)
from modal_rl.weightsync.errors import CorruptFrameError
from modal_rl.weightsync.wire.chunk_header import (  # noqa: E402, F401  (re-exported: the chunk format's names)
    CHUNK_HEADER,
    CTX_SPARSE,
    DENSE,
    ENCODING_NAMES,
    FULL,
    SPARSE,
    SUB_DENSE,
    SUB_SPARSE,
    UNCHANGED,
    XOR_DENSE,
    XOR_SPARSE,
)

MAX_CHUNK_ELEMS = 1 << 28
GAP_ESCAPE = 255
GAP_STREAMS = 5  # gap bytes + 4 exception planes
# Above this density the gap stream costs more than byte-split dense planes
# (measured by `python -m benchmarks weight-sync`, synthetic grid).
DENSE_DENSITY = 0.35
# The order-0 coder of a sparse chunk's noisy residual planes: rANS under a static table,
# smaller and faster than Huffman-only DEFLATE there (``benchmarks weight-sync-coder``).
SPARSE_NOISY = RANS0


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    elem_start: int
    elem_count: int


def _signed(word: np.dtype) -> np.dtype:
    return np.dtype(f"<i{np.dtype(word).itemsize}")


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Map wrapping differences to small unsigned words: 0, -1, 1, -2, … → 0, 1, 2, 3, …"""
    s = diff.view(_signed(diff.dtype))
    bits = 8 * diff.dtype.itemsize
    return ((s << 1) ^ (s >> (bits - 1))).view(diff.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (z.dtype.type(0) - (z & one))


def _plane_entropy_bits(planes: list[np.ndarray]) -> float:
    total = 0.0
    for plane in planes:
        counts = np.bincount(plane, minlength=256)
        counts = counts[counts > 0]
        total -= float((counts * np.log2(counts / plane.size)).sum())
    return total


def residual(kind: str, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    return old ^ new if kind == "xor" else zigzag(new - old)


def choose_residual(old: np.ndarray, new: np.ndarray) -> str:
    """The residual whose byte planes have the smaller order-0 entropy, judged on an evenly
    strided sample (the choice only affects size, never correctness); the sample and the
    rule are ``sparse_coder``'s, which the compiled coder applies to the same counts."""
    from modal_rl.weightsync.codec.codings.sparse_coder import SAMPLE, choose_kind

    step = max(1, old.size // SAMPLE)
    old, new = old[::step], new[::step]
    counts = np.array(
        [
            [np.bincount(p, minlength=256) for p in byte_planes(residual(kind, old, new))]
            for kind in ("xor", "sub")
        ]
    )
    return "xor" if choose_kind(counts) == 0 else "sub"


def gap_streams(positions: np.ndarray) -> list[np.ndarray]:
    """Escape-coded gaps of strictly increasing positions: gap bytes, then 4 exception planes."""
    gaps = np.diff(positions, prepend=-1) - 1
    small = np.minimum(gaps, GAP_ESCAPE).astype(np.uint8)
    exceptions = (gaps[gaps >= GAP_ESCAPE] - GAP_ESCAPE).astype("<u4")
    return [small, *byte_planes(exceptions)]


def encode_delta_chunk(
    chunk: ChunkSpec,
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    level: int,
    dense_xor: bool = False,
) -> bytes:
    """Body of a delta chunk from the changed positions (chunk-local), old and new words.
    ``dense_xor``: always the dense XOR with zstd planes (slime's xor + zstd-1, in our
    frame; ``CodecConfig(coding=0)``, for measurements)."""
    nchanged = int(positions.size)
    if nchanged == 0 and not dense_xor:
        return CHUNK_HEADER.pack(chunk.index, chunk.elem_count, 0, UNCHANGED, 0)
    dense = dense_xor or nchanged >= DENSE_DENSITY * chunk.elem_count
    compiled = None if dense else _compiled_coder(old, new)
    if compiled:  # the same bytes from one compiled pass (``sparse_coder``)
        kind, streams, coders = compiled.encode_sparse(positions, old, new, SPARSE_NOISY)
        encoding = XOR_SPARSE if kind == "xor" else SUB_SPARSE
        header = CHUNK_HEADER.pack(chunk.index, chunk.elem_count, nchanged, encoding, len(streams))
        return header + pack_streams(streams, coders, level)
    kind = "xor" if dense_xor else choose_residual(old, new)
    if dense:
        dense = np.zeros(chunk.elem_count, dtype=new.dtype)
        dense[positions] = residual(kind, old, new)
        streams = byte_planes(dense)
        coders = [ZSTD if dense_xor else pick_coder(p) for p in streams]
        encoding = XOR_DENSE if kind == "xor" else SUB_DENSE
    else:
        planes = byte_planes(residual(kind, old, new))
        streams = gap_streams(positions) + planes
        coders = [ZSTD] * GAP_STREAMS + [pick_coder(p, SPARSE_NOISY) for p in planes]
        encoding = XOR_SPARSE if kind == "xor" else SUB_SPARSE
    header = CHUNK_HEADER.pack(chunk.index, chunk.elem_count, nchanged, encoding, len(streams))
    return header + pack_streams(streams, coders, level)


def _compiled_coder(old: np.ndarray, new: np.ndarray):
    """The compiled sparse coder module for these words, or None (no numba, or words that
    are not one unsigned type: the numpy coder writes the same bytes)."""
    from modal_rl.weightsync.codec.codings import sparse_coder

    if old.dtype != new.dtype or old.dtype.kind != "u" or not sparse_coder.available():
        return None
    return sparse_coder


def encode_delta_chunk_v2(
    chunk: ChunkSpec,
    base_parts: list[np.ndarray],
    new_parts: list[np.ndarray],
    part_starts: list[int],
    level: int,
    link_bytes_per_s: float,
    costs=None,
) -> tuple[bytes, np.ndarray, np.ndarray]:
    """(body, chunk-local positions of the changed words, their old words) of a delta chunk
    of 2-byte words from the chunk's base and new words, given as parts (its tensors'
    words, ``part_starts`` chunk-local): v2 only where the wire time it saves on a link of
    ``link_bytes_per_s`` (each receiver's share) exceeds its extra decode time (``costs``:
    the receivers' ``decode_costs.DecodeCosts``, None for the defaults), else v1. Without a
    known link rate the encoder never comes here: v1 touches only the changes, v2 every word."""
    return _by_time(chunk, base_parts, new_parts, part_starts, level, link_bytes_per_s, costs)


def _by_time(chunk, base_parts, new_parts, part_starts, level, link_bytes_per_s: float, costs):
    """The coding whose wire + decode time is smaller on this link (``pick_by_time``), from
    the chunk's parts, diffed here part by part."""
    # a chunk always has at least one part (a tensor's words); the diff is v1's own
    # (64-bit blocks first), so coding for time costs the encoder no more than v1 does
    diffs = [diff_words(b, n) for b, n in zip(base_parts, new_parts, strict=True)]
    positions, old, new = join_diffs(diffs, part_starts)
    body = pick_by_time(
        chunk, base_parts, new_parts, part_starts, positions, old, new, level, link_bytes_per_s, costs
    )[0]
    return body, positions, old


def pick_by_time(
    chunk, base_parts, new_parts, part_starts, positions, old, new, level, link_bytes_per_s: float, costs
) -> tuple[bytes, bool]:
    """(body, whether it is v2): the coding whose wire + decode time is smaller on this link
    (``chunks_v2.v2_pays``), given the chunk's changes. v1 first: where even the best case of
    v2 (``V2_BEST_SHARE`` of v1's bytes) would not pay for its pass, v2 is not coded at all,
    which saves the encoder that pass too (``base_parts`` are read only then)."""
    from modal_rl.weightsync.codec.codings import chunks_v2

    v1 = encode_delta_chunk(chunk, positions, old, new, level)
    k = int(positions.size)
    best_v2 = int(len(v1) * chunks_v2.V2_BEST_SHARE)
    if k == 0 or not chunks_v2.v2_pays(len(v1), best_v2, chunk.elem_count, k, link_bytes_per_s, costs):
        return v1, False

    def header_for(nchanged: int) -> bytes:
        return CHUNK_HEADER.pack(chunk.index, chunk.elem_count, nchanged, CTX_SPARSE, chunks_v2.CTX_STREAMS)

    body = chunks_v2.encode(header_for, base_parts, new_parts, part_starts, level)[0]
    pays = body is not None and chunks_v2.v2_pays(
        len(v1), len(body), chunk.elem_count, k, link_bytes_per_s, costs
    )
    return (body, True) if pays else (v1, False)


def encode_full_chunk(chunk: ChunkSpec, words: np.ndarray, level: int) -> bytes:
    streams = byte_planes(words)
    header = CHUNK_HEADER.pack(chunk.index, chunk.elem_count, chunk.elem_count, FULL, len(streams))
    # Anchors are large and dense: zstd only, for its speed (Huffman-only DEFLATE is ~5x
    # slower); planes of mantissa noise are stored (zstd-1 gains < 0.01% there, at a cost).
    return header + pack_streams(streams, [_anchor_coder(p) for p in streams], level)


def _anchor_coder(plane: np.ndarray, sample: int = 1 << 14, noisy_bits: float = 7.9) -> int:
    """STORED for a plane whose sampled order-0 entropy is near 8 bits, else zstd tuned
    for literals (exponent and sign bytes have few matches worth finding)."""
    if plane.size < 4 * sample:
        return ZSTD
    picked = plane[:: plane.size // sample]
    return STORED if _plane_entropy_bits([picked]) / picked.size > noisy_bits else ZSTD_LITERALS


@dataclass
class DecodedChunk:
    """A validated chunk, ready to apply. ``positions`` are chunk-local; ``None`` = every word."""

    index: int
    elem_start: int
    elem_count: int
    nchanged: int
    encoding: int
    positions: np.ndarray | None
    values: np.ndarray | None  # residual words (XOR: the XOR; SUB: new - old), or new words (FULL)
    # v2 decodes into the held host words as it goes: ``apply`` then only writes device ones
    host_written: bool = False

    def apply(self, segments: list[tuple[int, Any]], undo: bool = False) -> None:
        """Write into the words of a group: ``segments`` are (offset in the group's word
        space, that tensor's flat words), in order. Words are numpy arrays, or torch integer
        views of device tensors (decoded here on the host, written there on the device).
        ``undo=True`` reverts an applied chunk exactly — how a refused frame rolls back."""
        if self.encoding == UNCHANGED:
            return
        lo, hi = self.elem_start, self.elem_start + self.elem_count
        op = "set" if self.encoding == FULL else "xor" if self.encoding in (XOR_SPARSE, XOR_DENSE) else "add"
        # SUB_* and CTX_SPARSE carry new - old
        values = self.values
        if op == "add" and undo:
            values = values.dtype.type(0) - values
        if self.encoding in SPARSE:
            # chunk-local positions; a segment's words start at ``start - lo`` of them
            cuts = np.searchsorted(self.positions, [start - lo for start, _ in segments] + [hi - lo])
            for k, (start, words) in enumerate(segments):
                a, b = cuts[k], cuts[k + 1]
                if a == b or (self.host_written and not undo and isinstance(words, np.ndarray)):
                    continue
                if isinstance(words, np.ndarray):
                    scatter(words, self.positions[a:b], start - lo, values[a:b], op)
                else:
                    _update(words, self.positions[a:b] - (start - lo), values[a:b], op)
            return
        for start, words in segments:
            a, b = max(lo, start), min(hi, start + _size(words))
            if a < b:
                _update(words, slice(a - start, b - start), values[a - lo : b - lo], op)


def _size(words: Any) -> int:
    return int(words.size) if isinstance(words, np.ndarray) else int(words.numel())


def _to_device(values: np.ndarray, like: Any) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(values.view(_signed(values.dtype)))).to(like.device)


def _update(words: Any, where: np.ndarray | slice, values: np.ndarray, op: str) -> None:
    """``words[where] op= values`` with wrapping integer arithmetic, numpy or torch."""
    if not isinstance(words, np.ndarray):
        if not isinstance(where, slice):
            where = _to_device(where.astype(np.int64), words)
        values = _to_device(values, words)
    update(words, where, values, op)


def decode_chunk(body: bytes | memoryview, itemsize: int, chunk_elems: int, base_for=None) -> DecodedChunk:
    """Parse and validate a chunk body. Raises ``CorruptFrameError`` on any inconsistency.

    ``base_for(index, count)`` returns the chunk's held words as parts and their
    chunk-local starts (``chunks_v2.base_words``); v2 chunks need them, and decode into
    them (``DecodedChunk.host_written``); v1 never calls it.
    """
    body = memoryview(body)
    if len(body) < CHUNK_HEADER.size:
        raise CorruptFrameError("chunk body shorter than its header")
    index, count, nchanged, encoding, nstreams = CHUNK_HEADER.unpack_from(body, 0)
    word = np.dtype(f"<u{itemsize}")
    if count > MAX_CHUNK_ELEMS or nchanged > count:
        raise CorruptFrameError(f"chunk {index}: impossible sizes (count={count}, changed={nchanged})")
    expected = {UNCHANGED: 0, FULL: itemsize} | dict.fromkeys(SPARSE, GAP_STREAMS + itemsize)
    expected |= dict.fromkeys(DENSE, itemsize)
    expected[CTX_SPARSE] = 3 if itemsize == 2 else -1
    if encoding not in expected or nstreams != expected[encoding]:
        raise CorruptFrameError(f"chunk {index}: bad encoding {encoding} with {nstreams} streams")
    if encoding == CTX_SPARSE:
        from modal_rl.weightsync.codec.codings import chunks_v2

        if base_for is None:
            raise CorruptFrameError(f"chunk {index}: a v2 chunk where no held words are available")
        parts, part_starts = base_for(index, count)
        positions, values = chunks_v2.decode(body, index, count, nchanged, parts, part_starts)
        return DecodedChunk(index, index * chunk_elems, count, nchanged, encoding, positions, values, True)
    streams = unpack_streams(body, CHUNK_HEADER.size, nstreams, 4 * count)
    positions = values = None
    if encoding in SPARSE:
        small = np.frombuffer(streams[0], dtype=np.uint8)
        exception_planes = [np.frombuffer(s, np.uint8) for s in streams[1:GAP_STREAMS]]
        planes = [np.frombuffer(s, np.uint8) for s in streams[GAP_STREAMS:]]
        if small.size != nchanged or any(p.size != nchanged for p in planes):
            raise CorruptFrameError(f"chunk {index}: stream lengths disagree with {nchanged} changes")
        if len({p.size for p in exception_planes}) != 1:
            raise CorruptFrameError(f"chunk {index}: exception planes differ in length")
        gaps = small.astype(np.int64)
        escaped = small == GAP_ESCAPE
        if int(np.count_nonzero(escaped)) != exception_planes[0].size:
            raise CorruptFrameError(f"chunk {index}: gap exceptions do not match their escapes")
        gaps[escaped] += join_planes(exception_planes, np.dtype("<u4"))
        positions = np.cumsum(gaps + 1) - 1
        if positions.size and positions[-1] >= count:
            raise CorruptFrameError(f"chunk {index}: a position lies past the chunk's end")
        values = join_planes(planes, word)
    elif encoding != UNCHANGED:
        if any(len(s) != count for s in streams):
            raise CorruptFrameError(f"chunk {index}: plane lengths disagree with {count} words")
        values = join_planes([np.frombuffer(s, np.uint8) for s in streams], word)
    if encoding in (SUB_SPARSE, SUB_DENSE):
        values = unzigzag(values)
    return DecodedChunk(index, index * chunk_elems, count, nchanged, encoding, positions, values)
