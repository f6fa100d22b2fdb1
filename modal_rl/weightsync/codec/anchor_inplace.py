"""An anchor applied in place: the held state stays one copy across anchors.

An anchor that arrives while a state is held mostly repeats it (a few versions of sparse
updates apart), so building a complete second state beside it (what a fresh decode does)
doubles the receiver's memory for the length of the frame. Instead, each decoded anchor
chunk is compared with the held words it covers (``diffwords``, one compiled pass); only
the words that differ are written, and the words they overwrote go into an undo log: the
chunk's difference coded as an ordinary sparse delta chunk body (``chunks``: gaps and byte
planes, zstd-1), so the log costs a few bytes per differing word, not a word per held one.
A refused frame (a record whose MAC fails, a cut-off frame, a tensor whose sum does not
match) is rolled back exactly like a delta: every logged body is decoded and undone.

Which tensors are written in place (``held_target``): a held host tensor of the anchor's
name, dtype and shape; others (a new name, another shape, a device tensor) are decoded into
fresh tensors as before, and held tensors the anchor does not name are dropped when the
caller swaps the result in.

Invariants: after a successful apply every in-place tensor holds the anchor's words; after
a refusal every in-place tensor holds exactly its words from before the frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from modal_rl.weightsync.codec.codings.chunks import ChunkSpec, DecodedChunk, encode_delta_chunk
from modal_rl.weightsync.codec.diffwords import diff_words
from modal_rl.weightsync.codec.dtypes import dtype_name, is_torch, words_of
from modal_rl.weightsync.codec.scatter import scatter

UNDO_LEVEL = 1  # the undo log's zstd level: read back only on a refusal
WINDOW_WORDS = 1 << 18  # words compared per pass: bounds the diff's buffers, whatever the chunk size


def held_target(held: Any, dtype: str, shape: tuple[int, ...]) -> Any | None:
    """The held tensor an anchor's tensor may be written into in place, or None."""
    if held is None or (is_torch(held) and held.device.type != "cpu"):
        return None
    if dtype_name(held) != dtype or tuple(map(int, held.shape)) != tuple(shape):
        return None
    if is_torch(held) and not held.is_contiguous():
        return None
    if isinstance(held, np.ndarray) and not (held.flags.c_contiguous and held.flags.writeable):
        return None
    try:
        words_of(held)
    except (TypeError, ValueError):
        return None
    return held


def apply_full_chunk(
    segments: list[tuple[int, Any]], in_place: list[bool], chunk: DecodedChunk, log: Callable[[bytes], None]
) -> None:
    """Write a decoded anchor chunk into its group's words: fresh tensors take every word,
    in-place ones only the words that differ. Before the first in-place word is written,
    ``log`` gets the chunk's undo body (a sparse delta from the held words to the anchor's,
    chunk-local); nothing is logged when no in-place word differs.

    The compare runs over windows of ``WINDOW_WORDS`` words, so its scratch (positions, old
    and new words, sized for every word of the window changing) is bounded by the window,
    not by the chunk: what this keeps beyond the decoded chunk is only the difference."""
    lo, hi = chunk.elem_start, chunk.elem_start + chunk.elem_count
    values = chunk.values
    writes, positions, olds = [], [], []
    for (start, words), inplace in zip(segments, in_place, strict=True):
        a, b = max(lo, start), min(hi, start + words.size)
        if a >= b:
            continue
        if not inplace:
            np.copyto(words[a - start : b - start], values[a - lo : b - lo])
            continue
        for w in range(a, b, WINDOW_WORDS):
            e = min(b, w + WINDOW_WORDS)
            held = words[w - start : e - start]
            at, old, changed = diff_words(held, values[w - lo : e - lo])
            if at.size:
                writes.append((held, at, changed))
                positions.append(at + (w - lo))  # chunk-local, for the undo body
                olds.append(old)
    if not writes:
        return
    chunk_local = np.concatenate(positions) if len(positions) > 1 else positions[0]
    old = np.concatenate(olds) if len(olds) > 1 else olds[0]
    new = np.concatenate([c for _, _, c in writes]) if len(writes) > 1 else writes[0][2]
    del positions, olds
    log(encode_delta_chunk(ChunkSpec(chunk.index, lo, chunk.elem_count), chunk_local, old, new, UNDO_LEVEL))
    del chunk_local, old, new
    for held, at, changed in writes:
        scatter(held, at, 0, changed, "set")
