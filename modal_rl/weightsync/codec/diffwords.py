"""One-pass diff of two word arrays: the changed positions and their old and new words.

The encoder's diff reads every held word of both versions, so at model scale it is the
largest per-word cost of a delta (1 G words for a 2 GB bf16 state). numpy needed four
passes (a 64-bit block compare into a mask, its nonzero, the candidates' word compare,
two gathers); this numba kernel (``nogil``: the codec's threads diff chunks in parallel)
tests eight 64-bit blocks at a time and looks inside a changed group only, writing
position, old and new word as it goes. Measured on the real Adam trajectory's bf16 words
(one thread, 4 Mi-word chunks, out of cache): 0.47 ns a word against numpy's 1.12 on the
layers (1.1% changed), 0.13 against 0.26 on the embeddings (0.02% changed).

Invariant: the result is exactly numpy's (sorted positions, ``base[pos]``, ``new[pos]``);
without numba the numpy path runs.
"""

from __future__ import annotations

import numpy as np

from modal_rl.weightsync.codec.jit import Kernel


def _numpy_positions(b: np.ndarray, n: np.ndarray) -> np.ndarray:
    per_block = 8 // b.dtype.itemsize
    head = b.size - b.size % per_block if per_block > 1 else 0
    if head == 0 or not (b.flags.c_contiguous and n.flags.c_contiguous):  # no 64-bit view
        return np.flatnonzero(np.not_equal(b, n))
    blocks = np.flatnonzero(np.not_equal(b[:head].view(np.uint64), n[:head].view(np.uint64)))
    candidates = (blocks[:, None] * per_block + np.arange(per_block)).reshape(-1)
    positions = candidates[np.not_equal(b[candidates], n[candidates])]
    if head < b.size:
        tail = np.flatnonzero(np.not_equal(b[head:], n[head:])) + head
        positions = np.concatenate([positions, tail])
    return positions


GROUP = 8  # 64-bit blocks tested together: one branch per 64 bytes, a loop LLVM vectorizes


def _diff_kernel(b, n, b64, n64, per_block, pos, old, new):
    """Write the changed words' positions, old and new words; returns how many."""
    k = 0
    whole = b64.size - b64.size % GROUP
    for g in range(0, whole, GROUP):
        acc = np.uint64(0)
        for t in range(GROUP):
            acc |= b64[g + t] ^ n64[g + t]
        if acc:
            for j in range(g * per_block, (g + GROUP) * per_block):
                if b[j] != n[j]:
                    pos[k] = j
                    old[k] = b[j]
                    new[k] = n[j]
                    k += 1
    for j in range(whole * per_block, b.size):  # the words after the last whole group
        if b[j] != n[j]:
            pos[k] = j
            old[k] = b[j]
            new[k] = n[j]
            k += 1
    return k


DIFF = Kernel(_diff_kernel)  # numba is imported on the first diff (``jit``)


def diff_words(b: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted positions where ``b`` and ``n`` differ, ``b`` there, ``n`` there); both
    contiguous 1-D arrays of one unsigned word type."""
    kernel = DIFF.get()
    if kernel is None or not (b.flags.c_contiguous and n.flags.c_contiguous):
        positions = _numpy_positions(b, n)
        return positions, b[positions], n[positions]
    per_block = max(1, 8 // b.dtype.itemsize)
    head = b.size - b.size % per_block
    # sized for every word changing: np.empty touches no page a sparse delta does not write
    pos = np.empty(b.size, np.int64)
    old, new = np.empty(b.size, b.dtype), np.empty(b.size, b.dtype)
    k = kernel(b, n, b[:head].view(np.uint64), n[:head].view(np.uint64), per_block, pos, old, new)
    return pos[:k].copy(), old[:k].copy(), new[:k].copy()


def join_diffs(diffs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], starts: list[int]):
    """One chunk's (positions, old, new) from its parts' diffs, each part's positions
    shifted by its chunk-local start. A single part's arrays are used as they are (the
    diffs own them), so a one-tensor chunk is not copied."""
    if len(diffs) == 1:
        positions, old, new = diffs[0]
        positions += starts[0]
        return positions, old, new
    positions = np.concatenate([p + s for (p, _, _), s in zip(diffs, starts, strict=True)])
    return positions, np.concatenate([o for _, o, _ in diffs]), np.concatenate([n for _, _, n in diffs])
