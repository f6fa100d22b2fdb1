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
from modal_rl.weightsync.codec.diffwords import diff_words, join_diffs
from modal_rl.weightsync.codec.dtypes import dtype_name, is_torch, words_of
from modal_rl.weightsync.codec.scatter import scatter

UNDO_LEVEL = 1  # the undo log's zstd level: read back only on a refusal


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
    chunk-local); nothing is logged when no in-place word differs."""
    lo, hi = chunk.elem_start, chunk.elem_start + chunk.elem_count
    values = chunk.values
    writes, diffs, starts = [], [], []
    for (start, words), inplace in zip(segments, in_place, strict=True):
        a, b = max(lo, start), min(hi, start + words.size)
        if a >= b:
            continue
        new = values[a - lo : b - lo]
        held = words[a - start : b - start]
        if not inplace:
            np.copyto(held, new)
            continue
        positions, old, changed = diff_words(held, new)
        if positions.size:
            writes.append((held, positions, changed))
            diffs.append((positions.copy(), old, changed))  # join_diffs may shift them in place
            starts.append(a - lo)
    if not diffs:
        return
    positions, old, new = join_diffs(diffs, starts)
    log(encode_delta_chunk(ChunkSpec(chunk.index, lo, chunk.elem_count), positions, old, new, UNDO_LEVEL))
    for held, positions, changed in writes:
        scatter(held, positions, 0, changed, "set")
