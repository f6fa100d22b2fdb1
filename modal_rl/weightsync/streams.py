"""Chunk bodies: how one chunk of one tensor is laid out on the wire.

A chunk covers ``elem_count`` consecutive words of a tensor, starting at word
``index × chunk_elems``. Its body is a fixed header followed by ``nstreams`` streams, each
stored raw, zstd-compressed, or Huffman-coded (raw DEFLATE with the Huffman-only strategy);
the encoder keeps whichever is smaller of raw and the coder it picked. Encodings:

- ``UNCHANGED``: no word differs; no streams.
- ``XOR_SPARSE``: positions as gaps (``gap = pos[i] - pos[i-1] - 1``, ``pos[-1] = -1``),
  escape-coded (one byte ``min(gap, 255)``; gaps >= 255 also put ``gap - 255`` as a u32 into
  four byte-plane exception streams), then the changed words' XOR with the base, split into byte planes
  (plane k = byte k of each little-endian word). Planes separate the near-constant high
  bytes (sign, exponent) from the noisy low mantissa bytes, which is what lets zstd's
  order-0 entropy stage get close to the entropy bound.
- ``XOR_DENSE``: the XOR of every word, byte-split; cheaper than gaps when most words change.
- ``FULL``: the new words themselves, byte-split (anchors).

Invariant: decoding validates every length and range before anything is written, so a
malformed body raises ``CorruptFrameError`` and never touches the target words.
"""

from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

from modal_rl.weightsync.errors import CorruptFrameError

UNCHANGED, XOR_SPARSE, XOR_DENSE, FULL = 0, 1, 2, 3
ENCODING_NAMES = {UNCHANGED: "unchanged", XOR_SPARSE: "xor-sparse", XOR_DENSE: "xor-dense", FULL: "full"}

STORED, ZSTD, HUFFMAN = 0, 1, 2
# chunk_index u32, elem_count u32, nchanged u32, encoding u8, nstreams u8
CHUNK_HEADER = struct.Struct("<IIIBB")
# Streams are headed by three LEB128 varints: method, raw length, stored length.
MAX_CHUNK_ELEMS = 1 << 28
GAP_ESCAPE = 255
# Above this density the gap stream costs more than byte-split dense XOR planes
# (measured by `python -m benchmarks weight-sync`, synthetic grid).
DENSE_DENSITY = 0.35

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not thread-safe; one per thread and level.
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


def byte_planes(words: np.ndarray) -> list[np.ndarray]:
    """Split words into ``itemsize`` contiguous byte planes, low byte first."""
    itemsize = words.dtype.itemsize
    if itemsize == 1:
        return [words.view(np.uint8)]
    word = words.dtype.type
    return [(words >> word(8 * k)).astype(np.uint8) for k in range(itemsize)]


def join_planes(planes: list[np.ndarray], word: np.dtype) -> np.ndarray:
    word = np.dtype(word)
    out = planes[0].astype(word)
    for k, plane in enumerate(planes[1:], start=1):
        out |= plane.astype(word) << word.type(8 * k)
    return out


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(body: memoryview, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(body) or shift > 63:
            raise CorruptFrameError("chunk body ends inside a stream header")
        byte = body[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7


def _huffman(raw) -> bytes:
    # Raw DEFLATE, Huffman-only: an order-0 coder with per-block tables; zlib drops the GIL.
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(raw) + c.flush()


def pick_coder(stream: np.ndarray) -> int:
    """Huffman for noisy byte planes, zstd for planes that are mostly zero (see module doc)."""
    if stream.size < 64:
        return ZSTD
    return HUFFMAN if np.count_nonzero(stream) * 2 > stream.size else ZSTD


def _pack_streams(streams: list[np.ndarray], coders: list[int], level: int) -> bytes:
    parts = []
    for stream, coder in zip(streams, coders, strict=True):
        raw = memoryview(np.ascontiguousarray(stream)).cast("B")
        coded = None
        if len(raw) >= 32:
            coded = _huffman(raw) if coder == HUFFMAN else _compressor(level).compress(raw)
        if coded is not None and len(coded) < len(raw):
            parts += [_varint(coder) + _varint(len(raw)) + _varint(len(coded)), coded]
        else:
            parts += [_varint(STORED) + _varint(len(raw)) + _varint(len(raw)), bytes(raw)]
    return b"".join(parts)


def gap_streams(positions: np.ndarray) -> list[np.ndarray]:
    """Escape-coded gaps of strictly increasing positions: gap bytes, then 4 exception planes."""
    gaps = np.diff(positions, prepend=-1) - 1
    small = np.minimum(gaps, GAP_ESCAPE).astype(np.uint8)
    exceptions = (gaps[gaps >= GAP_ESCAPE] - GAP_ESCAPE).astype("<u4")
    return [small, *byte_planes(exceptions)]


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    elem_start: int
    elem_count: int


GAP_STREAMS = 5  # gap bytes + 4 exception planes


def encode_xor_chunk(chunk: ChunkSpec, positions: np.ndarray, xor_words: np.ndarray, level: int) -> bytes:
    """Body of a delta chunk from the changed positions (chunk-local) and their XOR words."""
    nchanged = int(positions.size)
    if nchanged == 0:
        return CHUNK_HEADER.pack(chunk.index, chunk.elem_count, 0, UNCHANGED, 0)
    if nchanged >= DENSE_DENSITY * chunk.elem_count:
        dense = np.zeros(chunk.elem_count, dtype=xor_words.dtype)
        dense[positions] = xor_words
        streams = byte_planes(dense)
        coders = [pick_coder(p) for p in streams]
        encoding = XOR_DENSE
    else:
        planes = byte_planes(xor_words)
        streams = gap_streams(positions) + planes
        coders = [ZSTD] * GAP_STREAMS + [pick_coder(p) for p in planes]
        encoding = XOR_SPARSE
    header = CHUNK_HEADER.pack(chunk.index, chunk.elem_count, nchanged, encoding, len(streams))
    return header + _pack_streams(streams, coders, level)


def encode_full_chunk(chunk: ChunkSpec, words: np.ndarray, level: int) -> bytes:
    streams = byte_planes(words)
    header = CHUNK_HEADER.pack(chunk.index, chunk.elem_count, chunk.elem_count, FULL, len(streams))
    # Anchors are large and dense: zstd only, for its speed (Huffman-only DEFLATE is ~5x slower).
    return header + _pack_streams(streams, [ZSTD] * len(streams), level)


@dataclass
class DecodedChunk:
    """A validated chunk, ready to apply. ``positions`` are chunk-local; ``None`` = every word."""

    index: int
    elem_start: int
    elem_count: int
    nchanged: int
    encoding: int
    positions: np.ndarray | None
    values: np.ndarray | None  # XOR words (XOR_*) or new words (FULL)

    def apply(self, segments: list[tuple[int, np.ndarray]]) -> None:
        """Write into the words of a group: ``segments`` are (offset in the group's word
        space, that tensor's flat words), in order. XOR encodings are involutions: applying
        the same chunk twice restores the base, which is how a refused frame is rolled back."""
        if self.encoding == UNCHANGED:
            return
        lo, hi = self.elem_start, self.elem_start + self.elem_count
        if self.encoding == XOR_SPARSE:
            group_positions = self.positions + lo
            starts = [start for start, _ in segments]
            cuts = np.searchsorted(group_positions, starts + [hi])
            for k, (start, words) in enumerate(segments):
                a, b = cuts[k], cuts[k + 1]
                if a < b:
                    words[group_positions[a:b] - start] ^= self.values[a:b]
            return
        for start, words in segments:
            a, b = max(lo, start), min(hi, start + words.size)
            if a >= b:
                continue
            window = words[a - start : b - start]
            values = self.values[a - lo : b - lo]
            if self.encoding == XOR_DENSE:
                np.bitwise_xor(window, values, out=window)
            else:
                window[:] = values


def _decode_stream(method: int, data: memoryview, raw_len: int) -> bytes:
    if method == STORED:
        if raw_len != len(data):
            raise CorruptFrameError("stored stream length mismatch")
        return bytes(data)
    if method == ZSTD:
        try:
            raw = _decompressor().decompress(data, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise CorruptFrameError(f"zstd stream does not decode: {exc}") from exc
    elif method == HUFFMAN:
        inflater = zlib.decompressobj(-15)
        try:
            raw = inflater.decompress(data, raw_len)
        except zlib.error as exc:
            raise CorruptFrameError(f"huffman stream does not decode: {exc}") from exc
        if not inflater.eof or inflater.unconsumed_tail:
            raise CorruptFrameError("huffman stream does not end where its header says")
    else:
        raise CorruptFrameError(f"unknown stream method {method}")
    if len(raw) != raw_len:
        raise CorruptFrameError("stream decodes to the wrong length")
    return raw


def _unpack_streams(body: memoryview, offset: int, nstreams: int, max_raw: int) -> list[bytes]:
    out = []
    for _ in range(nstreams):
        method, offset = _read_varint(body, offset)
        raw_len, offset = _read_varint(body, offset)
        stored_len, offset = _read_varint(body, offset)
        if raw_len > max_raw or offset + stored_len > len(body):
            raise CorruptFrameError("chunk body ends inside a stream, or a stream is impossibly long")
        out.append(_decode_stream(method, body[offset : offset + stored_len], raw_len))
        offset += stored_len
    if offset != len(body):
        raise CorruptFrameError("trailing bytes after the chunk's streams")
    return out


def decode_chunk(body: bytes | memoryview, itemsize: int, chunk_elems: int) -> DecodedChunk:
    """Parse and validate a chunk body. Raises ``CorruptFrameError`` on any inconsistency."""
    body = memoryview(body)
    if len(body) < CHUNK_HEADER.size:
        raise CorruptFrameError("chunk body shorter than its header")
    index, count, nchanged, encoding, nstreams = CHUNK_HEADER.unpack_from(body, 0)
    word = np.dtype(f"<u{itemsize}")
    if count > MAX_CHUNK_ELEMS or nchanged > count:
        raise CorruptFrameError(f"chunk {index}: impossible sizes (count={count}, changed={nchanged})")
    expected_streams = {UNCHANGED: 0, XOR_SPARSE: GAP_STREAMS + itemsize, XOR_DENSE: itemsize, FULL: itemsize}
    if encoding not in expected_streams or nstreams != expected_streams[encoding]:
        raise CorruptFrameError(f"chunk {index}: bad encoding {encoding} with {nstreams} streams")
    streams = _unpack_streams(body, CHUNK_HEADER.size, nstreams, 4 * count)
    positions = values = None
    if encoding == XOR_SPARSE:
        small = np.frombuffer(streams[0], dtype=np.uint8)
        exception_planes = [np.frombuffer(s, np.uint8) for s in streams[1:GAP_STREAMS]]
        xor_planes = [np.frombuffer(s, np.uint8) for s in streams[GAP_STREAMS:]]
        if small.size != nchanged or any(p.size != nchanged for p in xor_planes):
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
        values = join_planes(xor_planes, word)
    elif encoding in (XOR_DENSE, FULL):
        if any(len(s) != count for s in streams):
            raise CorruptFrameError(f"chunk {index}: plane lengths disagree with {count} words")
        values = join_planes([np.frombuffer(s, np.uint8) for s in streams], word)
    return DecodedChunk(index, index * chunk_elems, count, nchanged, encoding, positions, values)
