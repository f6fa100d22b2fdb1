"""The publisher's diff and the move of its ls128 sum (``linsum``) in one pass over the words.

The diff already compares every 8-byte block of the base and the new words; where two blocks
differ, both values are in registers, so the sum's move for that block costs four mixes and
no memory traffic. A separate ``linsum.delta_sum`` after the diff would read each changed
block again (at 1% changed bf16 words nearly every cache line of the tensor).

Invariant: ``diff_and_move(b, n, first_block)`` returns ``diff_words(b, n)`` and
``linsum.delta_sum(n, positions, old)`` for ``b``, ``n`` that start at 8-byte block
``first_block`` of their tensor (a chunk start: chunks are multiples of 8 words).
"""

from __future__ import annotations

import numpy as np

from modal_rl.weightsync.codec import linsum
from modal_rl.weightsync.codec.diffwords import GROUP, diff_words
from modal_rl.weightsync.codec.jit import Kernel
from modal_rl.weightsync.codec.linsum import P1, P2, S1, S2


def _diff_sum_kernel(b, n, b64, n64, per, first_block, pos, old, new):
    """``diffwords._diff_kernel``'s result and the move of the sum over its whole groups of
    blocks; words after the last whole group are diffed but not summed (the caller sums them)."""
    k = 0
    a = np.uint64(0)
    c = np.uint64(0)
    whole = b64.size - b64.size % GROUP
    for g in range(0, whole, GROUP):
        acc = np.uint64(0)
        for t in range(GROUP):
            acc |= b64[g + t] ^ n64[g + t]
        if acc:
            for t in range(GROUP):
                x = b64[g + t]
                y = n64[g + t]
                if x != y:
                    bb = np.uint64(first_block + g + t)
                    a += _m1(y ^ (bb * P1 + S1)) - _m1(x ^ (bb * P1 + S1))
                    c += _m2(y + ((bb * P2) ^ S2)) - _m2(x + ((bb * P2) ^ S2))
                    for j in range((g + t) * per, (g + t + 1) * per):
                        if b[j] != n[j]:
                            pos[k] = j
                            old[k] = b[j]
                            new[k] = n[j]
                            k += 1
    for j in range(whole * per, b.size):
        if b[j] != n[j]:
            pos[k] = j
            old[k] = b[j]
            new[k] = n[j]
            k += 1
    return k, a, c


_m1 = _m2 = None  # linsum's compiled mixers, bound on first use
_KERNEL = Kernel(_diff_sum_kernel)


def diff_and_move(b: np.ndarray, n: np.ndarray, first_block: int):
    """(positions, old words, new words, move of the sum) of ``b`` → ``n`` (see the module)."""
    global _m1, _m2
    per = max(1, 8 // b.dtype.itemsize)
    kernels = linsum._compiled()
    if kernels is None or not (b.flags.c_contiguous and n.flags.c_contiguous):
        positions, old, new = diff_words(b, n)
        return positions, old, new, _move(n, positions, old, per, first_block, 0)
    _m1, _m2 = linsum._m1, linsum._m2
    head = b.size - b.size % per
    pos = np.empty(b.size, np.int64)
    old, new = np.empty(b.size, b.dtype), np.empty(b.size, b.dtype)
    b64, n64 = b[:head].view(np.uint64), n[:head].view(np.uint64)
    k, a, c = _KERNEL.get()(b, n, b64, n64, per, first_block, pos, old, new)
    positions, old, new = pos[:k].copy(), old[:k].copy(), new[:k].copy()
    summed_to = (b64.size - b64.size % GROUP) * per  # the kernel summed the words before this
    rest = _move(n, positions, old, per, first_block, summed_to)
    return positions, old, new, linsum.add_sums(f"{int(a):016x}{int(c):016x}", rest)


def _move(
    n: np.ndarray, positions: np.ndarray, old: np.ndarray, per: int, first_block: int, start: int
) -> str:
    """The sum's move of the changes at or after word ``start`` (a block boundary) of ``n``."""
    at = int(np.searchsorted(positions, start))
    if at == positions.size:
        return linsum.EMPTY
    tail = n[start:]
    ids = np.arange(first_block + start // per, first_block + start // per + -(-tail.size // per))
    return linsum.delta_sum(tail, positions[at:] - start, old[at:], block_ids=ids)
