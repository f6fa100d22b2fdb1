"""Residual model of the v2 chunk coding (see ``ctxcoder``): numba kernels, ``nogil``.

Residual model. ``z = zigzag(new - old)`` (never 0) as a symbol (``z`` below 8, else its
bit length and the bit after the leading one) with per-exponent frequencies learned as
the chunk is coded (an observation weighs 32 prior counts; rebuilt when a context's
count doubles), then the remaining bits uniform.
"""

from __future__ import annotations

import numpy as np

from modal_rl.weightsync.codec.codings.ctxrans import (
    M,
    _advance,
    _dec_uniform,
    _kernel,
    _push,
    _push_uniform,
)

RES_CTX = 256
RES_SYM = 34
RES_FIRST_REBUILD = 1
RES_INC = 32  # an observation weighs 32 prior counts: unseen symbols stay cheap to exclude


@_kernel
def _res_symbol(z):
    if z < 8:
        return z, 0
    b = 0
    while z >> b:
        b += 1
    return 8 + 2 * (b - 4) + ((z >> (b - 2)) & 1), b - 2


@_kernel
def _rebuild(counts, cum, c):
    """Context ``c``'s cumulative table from its counts: ``max(1, floor(count * (M -
    RES_SYM) / total))`` per symbol, the rest of ``M`` to the most frequent one. Called at
    each doubling of a context's observations, so it is in the decoder's per-change cost:
    the floors are a float product corrected to the exact integer result (a third of the
    time of 34 integer divisions), and no array is allocated."""
    total = 0
    for s in range(RES_SYM):
        total += counts[c, s]
    inv = 1.0 / total
    acc = 0
    big, bigf = 0, -1
    for s in range(RES_SYM):
        a = counts[c, s] * (M - RES_SYM)  # < 2**50: exact in a double, estimate within 1
        f = np.int64(a * inv)
        if f * total > a:
            f -= 1
        elif (f + 1) * total <= a:
            f += 1
        f = max(1, f)
        cum[c, s + 1] = f  # the frequencies first, summed up below
        acc += f
        if f > bigf:
            big, bigf = s, f
    cum[c, big + 1] += M - acc
    cum[c, 0] = 0
    for s in range(RES_SYM):
        cum[c, s + 1] += cum[c, s]


def _initial_cum() -> np.ndarray:
    counts = np.ones((1, RES_SYM), dtype=np.int64)
    cum = np.zeros((1, RES_SYM + 1), dtype=np.int64)
    _rebuild(counts, cum, 0)
    return cum[0]


INITIAL_CUM = _initial_cum()  # every context starts from the same flat model


@_kernel
def res_model():
    """A fresh residual model: (counts, cumulative frequencies, observations, next rebuild)."""
    counts = np.ones((RES_CTX, RES_SYM), dtype=np.int64)
    cum = np.empty((RES_CTX, RES_SYM + 1), dtype=np.int64)
    for c in range(RES_CTX):
        cum[c] = INITIAL_CUM
    seen = np.zeros(RES_CTX, dtype=np.int64)
    nextb = np.full(RES_CTX, RES_FIRST_REBUILD, dtype=np.int64)
    return counts, cum, seen, nextb


@_kernel
def _res_learn(counts, cum, seen, nextb, c, sym):
    counts[c, sym] += RES_INC
    seen[c] += 1
    if seen[c] == nextb[c]:
        nextb[c] *= 2
        _rebuild(counts, cum, c)


@_kernel
def residual_symbols(old, new):
    """(start, freq) of the residuals of the changed words, in word order."""
    nch = old.size
    starts = np.empty(nch * 3, dtype=np.int64)
    freqs = np.empty(nch * 3, dtype=np.int64)
    counts, cum, seen, nextb = res_model()
    t = 0
    for j in range(nch):
        d = (np.int64(new[j]) - np.int64(old[j])) & 0xFFFF
        s = d - 0x10000 if d >= 0x8000 else d
        z = ((s << 1) ^ (s >> 63)) & 0xFFFF
        c = (np.int64(old[j]) >> 7) & 0xFF
        sym, nb = _res_symbol(z)
        t = _push(starts, freqs, t, cum[c, sym], cum[c, sym + 1] - cum[c, sym])
        if nb:
            t = _push_uniform(starts, freqs, t, z, nb)
        _res_learn(counts, cum, seen, nextb, c, sym)
    return starts[:t], freqs[:t]


@_kernel
def res_decode_one(old, rwords, rx, rw, counts, cum, seen, nextb):
    """The residual ``new - old`` (wrapping u16) of one changed word, in word order.
    Returns (residual, rx, rw, ok); not ok: the stream cannot be this chunk's."""
    c = (np.int64(old) >> 7) & 0xFF
    slot = rx & (M - 1)
    # the first four symbols (most residuals: ±1, ±2 ulps) without a branch, then a search;
    # the cumulative table is strictly increasing, so the count is the symbol (2-3% of a
    # decode faster than searching from 0, whose exit the scan's branches hide from the
    # predictor)
    sym = np.int64(cum[c, 1] <= slot) + np.int64(cum[c, 2] <= slot) + np.int64(cum[c, 3] <= slot)
    sym += np.int64(cum[c, 4] <= slot)
    if sym == 4:
        while sym < RES_SYM - 1 and cum[c, sym + 1] <= slot:
            sym += 1
    rx, rw = _advance(rx, rwords, rw, slot, cum[c, sym], cum[c, sym + 1] - cum[c, sym])
    if sym < 8:
        z = np.int64(sym)
    else:
        b = (sym - 8) // 2 + 4
        v, rx, rw = _dec_uniform(rx, rwords, rw, b - 2)
        z = (np.int64(1) << (b - 1)) | (np.int64((sym - 8) & 1) << (b - 2)) | v
    if rw > rwords.size or z == 0:
        return np.uint16(0), rx, rw, False
    _res_learn(counts, cum, seen, nextb, c, sym)
    return np.uint16(((z >> 1) ^ -(z & 1)) & 0xFFFF), rx, rw, True
