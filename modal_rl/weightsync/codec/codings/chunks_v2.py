"""Chunk coding v2: context-conditioned entropy coding of a sparse bf16 delta.

The model conditions on what the receiver already holds — the base words — so the frame
carries only what the receiver cannot derive (see ``ctxcoder`` for the models):

- **mask**: which words changed, coded per context (tensor segment × base exponent) as
  run lengths under a geometric model with ``p = k / n``. The receiver counts ``n`` (the
  words of each context) as it decodes; the frame carries ``p`` as one byte per context.
- **residual**: ``zigzag(new - old)`` of the changed words, adaptive per base exponent.

Body: the v1 chunk header with encoding ``CTX_SPARSE`` and three streams: the mask
model's ``q`` bytes (zstd), the mask's rANS words, the residual's rANS words (u32 LE, stored).
Only 2-byte words are coded this way; the encoder keeps the v1 body when it is smaller.
Decoding needs the chunk's base words and its tensors' boundaries. It writes the new
words as it finds them (one pass) and, when the streams turn out not to be this chunk's,
puts every written word back before raising ``CorruptFrameError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from modal_rl.weightsync.codec.streams import STORED, ZSTD, pack_streams, unpack_streams
from modal_rl.weightsync.errors import CorruptFrameError, WeightSyncError

CTX_SPARSE = 6
CTX_STREAMS = 3
# chunk_index u32, elem_count u32, nchanged u32, encoding u8, nstreams u8 (as v1)
ENCODING_OFFSET = 12


def _kernels():
    try:
        from modal_rl.weightsync.codec.codings import ctxcoder
    except ImportError as exc:  # numba missing
        raise WeightSyncError(f"v2 chunks need numba ({exc}); install it: pip install numba") from None
    return ctxcoder


def available() -> bool:
    try:
        _kernels()
    except WeightSyncError:
        return False
    return True


def segment_bounds(member_starts: list[int], count: int) -> np.ndarray:
    """Context segments of a chunk from its tensors' chunk-local starts: a tensor opens a
    new segment only when the current one holds at least ``SEG_MIN`` words, so a run of
    small tensors shares one (their own contexts would cost more ``k`` than they save)."""
    from modal_rl.weightsync.codec.codings.ctxcoder import SEG_MIN

    bounds = [0]
    for start in member_starts:
        if 0 < start < count and start - bounds[-1] >= SEG_MIN:
            bounds.append(start)
    bounds.append(count)
    return np.asarray(bounds, dtype=np.int64)


def _side_info(q: np.ndarray, nseg: int) -> np.ndarray:
    """Per segment: first and last exponent with changes (u8 each; 1, 0 = none), then
    their q bytes, each as the difference to the previous one (mod 256: smooth, so it
    compresses)."""
    out = []
    for row in q.reshape(nseg, 256):
        live = np.flatnonzero(row)
        if live.size == 0:
            out.append(np.array([1, 0], np.uint8))
            continue
        lo, hi = int(live[0]), int(live[-1])
        span = row[lo : hi + 1].astype(np.int16)
        out += [np.array([lo, hi], np.uint8), np.diff(span, prepend=0).astype(np.uint8)]
    return np.concatenate(out)


def _read_side_info(raw: np.ndarray, nseg: int, index: int) -> np.ndarray:
    q = np.zeros((nseg, 256), np.uint8)
    at = 0
    for s in range(nseg):
        if at + 2 > raw.size:
            raise CorruptFrameError(f"chunk {index}: context table ends early")
        lo, hi = int(raw[at]), int(raw[at + 1])
        at += 2
        if hi < lo:
            continue
        if at + hi - lo + 1 > raw.size:
            raise CorruptFrameError(f"chunk {index}: context table ends early")
        q[s, lo : hi + 1] = np.cumsum(raw[at : at + hi - lo + 1], dtype=np.uint8)
        at += hi - lo + 1
    if at != raw.size:
        raise CorruptFrameError(f"chunk {index}: trailing bytes after the context table")
    return q.reshape(-1)


def _segment_offsets(part_starts: list[int], bounds: np.ndarray) -> list[int]:
    """Per part, ``256 ×`` its context segment: every part lies in one segment, since
    segments only ever start where a part (a tensor) does."""
    return [256 * (int(np.searchsorted(bounds, start, side="right")) - 1) for start in part_starts]


def encode(
    header_for, base_parts: list[np.ndarray], new_parts: list[np.ndarray], part_starts: list[int], level: int
) -> tuple[bytes | None, np.ndarray, np.ndarray, np.ndarray]:
    """(v2 body or None when nothing changed, positions, old words, new words) of a chunk
    given as parts: its tensors' host words in chunk order, ``part_starts`` chunk-local
    (no part is copied into one array). ``header_for(nchanged)`` makes the chunk header."""
    k_ = _kernels()
    count = sum(p.size for p in base_parts)
    bounds = segment_bounds(part_starts, count)
    nctx = (bounds.size - 1) * 256
    n0, n1 = np.zeros(nctx, np.int32), np.zeros(nctx, np.int32)  # even / odd words
    last = np.full(nctx, -1, np.int64)
    # sized for every word changing; pages are only touched as far as changes go
    pos, ctxs, gaps = np.empty(count, np.int64), np.empty(count, np.int64), np.empty(count, np.int64)
    old_w, new_w = np.empty(count, np.uint16), np.empty(count, np.uint16)
    j = 0
    for b, n, start, uoff in zip(
        base_parts, new_parts, part_starts, _segment_offsets(part_starts, bounds), strict=True
    ):
        j = k_.encode_part(b, n, np.uint64(uoff), start, n0, n1, last, pos, ctxs, gaps, old_w, new_w, j)
    positions, old_w, new_w = pos[:j].copy(), old_w[:j].copy(), new_w[:j].copy()
    if j == 0:
        return None, positions, old_w, new_w
    n = n0.astype(np.int64) + n1
    ctxs, gaps = ctxs[:j], gaps[:j]
    q = k_.quantize_p(n, last, np.bincount(ctxs, minlength=nctx))
    mask_words = k_.mask_encode(n, last, ctxs, gaps, q)
    res_words = k_.rans_encode(*k_.residual_symbols(old_w, new_w))
    streams = [_side_info(q, bounds.size - 1), mask_words.view(np.uint8), res_words.view(np.uint8)]
    body = header_for(j) + pack_streams(streams, [ZSTD, STORED, STORED], level)
    return body, positions, old_w, new_w


def decode(
    body: memoryview, index: int, count: int, nchanged: int, parts: list[np.ndarray], part_starts: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a v2 chunk body into the chunk's held words, given as parts (as ``encode``):
    on return they hold the new words, and (chunk-local positions, residuals new - old)
    say what changed, to undo or to copy elsewhere. On ``CorruptFrameError`` the parts
    are as they were: every word written is put back."""
    from modal_rl.weightsync.wire.chunk_header import CHUNK_HEADER

    k_ = _kernels()
    if sum(p.size for p in parts) != count or any(p.dtype != np.uint16 for p in parts):
        raise CorruptFrameError(f"chunk {index}: v2 coding needs 2-byte words")
    bounds = segment_bounds(part_starts, count)
    streams = unpack_streams(body, CHUNK_HEADER.size, CTX_STREAMS, 16 * count + 64)
    q = _read_side_info(np.frombuffer(streams[0], np.uint8), bounds.size - 1, index)
    if len(streams[1]) % 4 or len(streams[2]) % 4:
        raise CorruptFrameError(f"chunk {index}: rANS streams are not whole words")
    words, rwords = np.frombuffer(streams[1], "<u4"), np.frombuffer(streams[2], "<u4")
    positions, old_w, values = (
        np.empty(nchanged, np.int64),
        np.empty(nchanged, np.uint16),
        np.empty(nchanged, np.uint16),
    )
    nxt, state = k_.decode_start(q, words, rwords)
    model = k_.res_model()
    ok = all(
        k_.decode_part(
            b, np.uint64(uoff), start, q, words, rwords, nxt, state, model, positions, old_w, values
        )
        for b, start, uoff in zip(parts, part_starts, _segment_offsets(part_starts, bounds), strict=True)
    )
    if not (ok and k_.decode_finish(q, words, rwords, nxt, state, nchanged)):
        _put_back(parts, part_starts, positions[: state[2]], old_w[: state[2]])
        raise CorruptFrameError(
            f"chunk {index}: the chunk does not decode against the held words (corrupt, or made from other weights)"
        )
    return positions, values


def _put_back(
    parts: list[np.ndarray], part_starts: list[int], positions: np.ndarray, old_w: np.ndarray
) -> None:
    """Restore the held words a refused chunk had already overwritten."""
    from modal_rl.weightsync.codec.scatter import scatter

    cuts = np.searchsorted(positions, list(part_starts) + [part_starts[-1] + parts[-1].size])
    for k, (part, start) in enumerate(zip(parts, part_starts, strict=True)):
        scatter(part, positions[cuts[k] : cuts[k + 1]], start, old_w[cuts[k] : cuts[k + 1]], "set")


def base_words(segments: list[tuple[int, Any]], lo: int, hi: int) -> tuple[list[np.ndarray], list[int]]:
    """Host words ``[lo, hi)`` of a group's word space as parts (one per tensor there, in
    order) and their chunk-local starts. Host words are views; torch words are copied to
    the host."""
    parts, starts = [], []
    for start, words in segments:
        size = int(words.size) if isinstance(words, np.ndarray) else int(words.numel())
        a, b = max(lo, start), min(hi, start + size)
        if a >= b:
            continue
        piece = words[a - start : b - start]
        if not isinstance(piece, np.ndarray):
            # a host copy (never the held memory, even for a CPU tensor): decoding writes
            # into it, and the held torch words are written by the chunk's apply
            piece = piece.cpu().numpy().copy() if piece.device.type == "cpu" else piece.cpu().numpy()
        parts.append(piece.view(np.uint16) if piece.dtype.itemsize == 2 else piece)
        starts.append(a - lo)
    return parts, starts


V2_BEST_SHARE = 0.5  # v2 has never been under half of v1's bytes on any measured case


def v2_pays(v1_len: int, v2_len: int, count: int, nchanged: int, link_bytes_per_s: float, costs=None) -> bool:
    """Whether a v2 body of ``v2_len`` bytes reaches a receiver that gets
    ``link_bytes_per_s`` of the link sooner than the v1 body of ``v1_len``: the wire time
    saved against the decode time added (``costs``: a ``decode_costs.DecodeCosts``, the
    receivers' own or the defaults: a pass over every held word, and more work per change).
    Only time depends on it."""
    from modal_rl.weightsync.codec.decode_costs import DEFAULT

    costs = costs or DEFAULT
    saved_s = (v1_len - v2_len) / link_bytes_per_s
    return saved_s > count * costs.word_s + nchanged * costs.change_s
