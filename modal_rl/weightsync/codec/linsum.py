"""The tensor checksum that follows the change: ``ls128``, updated from the changed words alone.

A tensor's bytes are read as 8-byte little-endian blocks (the last one zero-padded); block
``b`` with value ``v`` contributes ``g(b, v) = (mix1(v ^ (b·P1 + S1)), mix2(v + (b·P2 ^ S2)))``
-- two 64-bit lanes, each a different bijective finaliser of a position-keyed input -- and
the checksum is the sum of every block's contribution, lane by lane modulo 2^64 (128 bits,
as 32 hex digits). A sum follows the change: when some words change, only the blocks that
hold them move, so

    sum(new) = sum(old) + over touched blocks b of g(b, new block) - g(b, old block),

computed from the changed positions, their old words and the memory after the change: the
publisher and every receiver pay per changed word, not per held word, each version.

What it detects: any difference between two tensors' bytes (a wrong base, a corrupted or
misplaced apply) changes the sum unless the touched blocks' contributions cancel exactly,
which for a pseudo-random g is a 2^-128 event per pattern of differences. Addition, not XOR:
an XOR sum's move from A to B equals its move from B to A, so a receiver that re-applied an
XOR delta to the state it already produced (back to the base) would pass its check; with
addition the two moves are opposite and that receiver ends at 2·sum(base) - sum(new). It is not a MAC:
frames are authenticated by the run key (``wire.auth``); this sum proves the receiver rebuilt
what the sender holds. Because a running sum only sees the blocks a delta touches, a held
tensor damaged elsewhere is caught by a full recomputation (``full_sum``): every anchor
computes one on both sides, and receivers audit their held state on a timer (``chain``).

Invariants: ``full_sum(new) == add_sums(full_sum(old), delta_sum(new_words, pos, old_words))``
for any change, word size (1, 2, 4, 8 bytes) and length; the sums depend only on bytes, never
on how a tensor is split into chunks.
"""

from __future__ import annotations

import numpy as np

from modal_rl.weightsync.codec.jit import Kernel

P1, S1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0x243F6A8885A308D3)
P2, S2 = np.uint64(0xD6E8FEB86659FD93), np.uint64(0x13198A2E03707344)
EMPTY = "0" * 32  # the sum of a tensor with no bytes
# The most words an 8-byte block holds (1-byte words): chunks of a multiple of this many words
# never split a block, so each chunk's move of a sum is its own (chunks apply in parallel).
SUM_BLOCK_WORDS = 8


def _mix1(x):  # murmur3's fmix64: a bijection with full avalanche
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> np.uint64(33))


def _mix2(x):  # splitmix64's finaliser: another bijection, other constants and shifts
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _full_kernel(blocks, tail, ntail_blocks, first_block):
    a = np.uint64(0)
    c = np.uint64(0)
    for b in range(blocks.size):
        v = blocks[b]
        bb = np.uint64(first_block + b)
        a += _m1(v ^ (bb * P1 + S1))
        c += _m2(v + ((bb * P2) ^ S2))
    for t in range(ntail_blocks):
        v = tail[t]
        bb = np.uint64(first_block + blocks.size + t)
        a += _m1(v ^ (bb * P1 + S1))
        c += _m2(v + ((bb * P2) ^ S2))
    return a, c


def _block(words, b, per, shift):
    """Block ``b`` of ``words`` (``per`` words of ``shift`` bits each), zero past the end."""
    v = np.uint64(0)
    lo = b * per
    for j in range(per):
        if lo + j < words.size:
            v |= np.uint64(words[lo + j]) << np.uint64(j * shift)
    return v


OLD_GIVEN, OLD_XOR, OLD_SUB = 0, 1, 2  # how ``values`` give a changed word's old value


def _delta_kernel(words, blocks, logper, shift, positions, offset, values, mode, block_ids):
    """Sum of g(b, new) - g(b, old) over the blocks holding ``positions - offset`` (sorted):
    ``words`` hold the new words (``blocks``: their whole 8-byte blocks as uint64). The old
    word at ``positions[i] - offset`` is ``values[i]`` (``OLD_GIVEN``), or the new word with
    the residual ``values[i]`` undone (``OLD_XOR``: ``new ^ r``; ``OLD_SUB``: ``new - r``: a
    receiver's chunk just applied). ``block_ids``: the true block number of each block of a
    compact ``words`` (empty: ``words`` is the whole tensor)."""
    a = np.uint64(0)
    c = np.uint64(0)
    per = 1 << logper
    mask = (np.uint64(1) << np.uint64(shift)) - np.uint64(1) if shift < 64 else ~np.uint64(0)
    i = 0
    n = positions.size
    while i < n:
        b = (positions[i] - offset) >> logper
        new = blocks[b] if b < blocks.size else _blk(words, b, per, shift)
        prev = new
        while i < n and ((positions[i] - offset) >> logper) == b:
            p = positions[i] - offset
            s = np.uint64((p & (per - 1)) * shift)
            v = np.uint64(values[i])
            if mode == OLD_XOR:
                v = np.uint64(words[p]) ^ v
            elif mode == OLD_SUB:
                v = (np.uint64(words[p]) - v) & mask
            prev = (prev & ~(mask << s)) | (v << s)
            i += 1
        bb = np.uint64(block_ids[b]) if block_ids.size else np.uint64(b)
        a += _m1(new ^ (bb * P1 + S1)) - _m1(prev ^ (bb * P1 + S1))
        c += _m2(new + ((bb * P2) ^ S2)) - _m2(prev + ((bb * P2) ^ S2))
    return a, c


# The kernels call these by name: numba compiles them when the kernels are first used.
_m1 = _m2 = _blk = None
_FULL, _DELTA = Kernel(_full_kernel), Kernel(_delta_kernel)


def _compiled():
    """(full, delta) kernels compiled with numba, or None (then the numpy path runs)."""
    global _m1, _m2, _blk
    if _m1 is None:
        try:
            from numba import njit
        except ImportError:
            return None
        _m1, _m2, _blk = (njit(nogil=True, cache=True)(f) for f in (_mix1, _mix2, _block))
    return _FULL.get(), _DELTA.get()


def _hex(a, c) -> str:
    return f"{int(a):016x}{int(c):016x}"


def _split(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the whole 8-byte blocks as uint64, the last partial block as uint64: zero-padded,
    empty when there is none)."""
    per = max(1, 8 // words.itemsize)
    head = words.size - words.size % per
    blocks = words[:head].view(np.uint64) if head else np.empty(0, np.uint64)
    rest = words[head:]
    tail = np.zeros(1 if rest.size else 0, np.uint64)
    for j, w in enumerate(rest.tolist()):
        tail[0] |= np.uint64(w) << np.uint64(j * 8 * words.itemsize)
    return blocks, tail


def full_sum(words: np.ndarray, first_block: int = 0) -> str:
    """The ls128 sum of a flat, contiguous array of unsigned words (hex). ``first_block``:
    the array is a slice of a larger tensor starting at that 8-byte block (its sum is then
    that slice's share, to add to the other slices' with ``add_sums``)."""
    blocks, tail = _split(words)
    kernels = _compiled()
    if kernels is not None:
        a, c = kernels[0](blocks, tail, tail.size, first_block)
        return _hex(a, c)
    ids = np.arange(first_block, first_block + blocks.size + tail.size, dtype=np.uint64)
    values = np.concatenate([blocks, tail])
    return _hex(*_numpy_g(ids, values))


def delta_sum(words: np.ndarray, positions: np.ndarray, old: np.ndarray, block_ids=None) -> str:
    """What takes the sum of the words before the change to the sum after it (``add_sums``):
    ``words`` (flat, after the change), ``positions`` (sorted int64) and ``old`` (the words
    there before). ``block_ids``: for a compact ``words`` of gathered blocks, their numbers."""
    if positions.size == 0:
        return EMPTY
    per, shift = max(1, 8 // words.itemsize), 8 * words.itemsize
    ids = np.empty(0, np.int64) if block_ids is None else np.asarray(block_ids, np.int64)
    if _compiled() is not None:
        return _delta(words, positions, 0, old.astype(words.dtype, copy=False), OLD_GIVEN, ids)
    blocks = np.unique(positions // per)
    idx = blocks[:, None] * per + np.arange(per)
    padded = np.concatenate([words, np.zeros(per, words.dtype)])
    new_words = padded[np.minimum(idx, words.size)].astype(np.uint64)
    old_words = new_words.copy()
    row = np.searchsorted(blocks, positions // per)
    old_words[row, positions - blocks[row] * per] = old.astype(np.uint64)
    weights = np.uint64(1) << (np.arange(per, dtype=np.uint64) * np.uint64(shift)) if per > 1 else None
    pack = (lambda w: (w * weights).sum(axis=1, dtype=np.uint64)) if per > 1 else (lambda w: w[:, 0])
    true_ids = (ids[blocks] if ids.size else blocks).astype(np.uint64)
    a1, c1 = _numpy_g(true_ids, pack(old_words))
    a2, c2 = _numpy_g(true_ids, pack(new_words))
    with np.errstate(over="ignore"):
        return _hex(a2 - a1, c2 - c1)


def _numpy_g(ids: np.ndarray, values: np.ndarray) -> tuple[np.uint64, np.uint64]:
    with np.errstate(over="ignore"):
        a = _mix1(values ^ (ids * P1 + S1))
        c = _mix2(values + ((ids * P2) ^ S2))
    return a.sum(dtype=np.uint64), c.sum(dtype=np.uint64)


def moved_by_residuals(
    words: np.ndarray, positions: np.ndarray, offset: int, residuals: np.ndarray, xor: bool
):
    """``delta_sum`` of words a chunk just wrote, at ``positions - offset`` (sorted), whose old
    values are the new ones with ``residuals`` undone (XOR, or subtract); None without numba
    (the caller then undoes them itself and calls ``delta_sum``)."""
    if _compiled() is None:
        return None
    mode = OLD_XOR if xor else OLD_SUB
    return _delta(words, positions, offset, residuals.view(words.dtype), mode, np.empty(0, np.int64))


def _delta(words, positions, offset: int, values, mode: int, block_ids) -> str:
    """The compiled delta kernel's sum over ``words`` (see ``_delta_kernel``), as hex."""
    logper, shift = max(1, 8 // words.itemsize).bit_length() - 1, 8 * words.itemsize
    kernel = _compiled()[1]
    return _hex(*kernel(words, _split(words)[0], logper, shift, positions, offset, values, mode, block_ids))


def add_sums(a: str, b: str) -> str:
    """Lane by lane ``a + b`` mod 2^64: the sum after a change from the sum before and the
    change's ``delta_sum``, or the sum of a tensor from its slices' sums."""
    mask = (1 << 64) - 1
    x, y = int(a, 16), int(b, 16)
    return f"{((x >> 64) + (y >> 64)) & mask:016x}{((x & mask) + (y & mask)) & mask:016x}"
