"""rANS primitives of the v2 chunk coding (see ``ctxcoder``): numba kernels, ``nogil``.

Coder: 64-bit rANS, 32-bit renormalisation, 16-bit frequencies (``M = 2**16``); states
stay below ``2**63``, so all arithmetic is int64. Symbols are (start, freq) pairs; a
decoder that runs out of words, or does not end in the encoder's initial state, reports
failure (``ok`` false) and never reads out of bounds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

PROB_BITS = 16
M = 1 << PROB_BITS
RANS_L = 1 << 31

_kernel = njit(nogil=True, cache=True)


@_kernel
def rans_encode(starts, freqs):
    """Encode symbols given as (start, freq) under M; returns the u32 words, in order."""
    count = starts.size
    out = np.empty(count + 4, dtype=np.uint32)
    n = 0
    x = np.int64(RANS_L)
    for i in range(count - 1, -1, -1):
        x, n = _put(x, out, n, starts[i], freqs[i])
    return _flush(x, out, n)


@_kernel
def _start(words):
    if words.size < 2:
        return np.int64(0), np.int64(words.size + 1)
    return (np.int64(words[0]) << 32) | np.int64(words[1]), np.int64(2)


@_kernel
def _advance(x, words, w, slot, start, f):
    x = f * (x >> PROB_BITS) + slot - start
    if x < RANS_L:
        if w < words.size:
            x = (x << 32) | np.int64(words[w])
        w += 1
    return x, w


@_kernel
def _dec_uniform(x, words, w, nb):
    f = np.int64(1) << (PROB_BITS - nb)
    slot = x & (M - 1)
    v = slot >> (PROB_BITS - nb)
    x, w = _advance(x, words, w, slot, v * f, f)
    return v, x, w


@_kernel
def _put(x, out, n, start, f):
    """rANS-encode one symbol (encoder runs in reverse); returns (x, n)."""
    if x >= (f << 47):
        out[n] = x & 0xFFFFFFFF
        n += 1
        x >>= 32
    # x < f << 47, so the quotient has < 48 bits: the float estimate is off by at most 1
    qt = np.int64(x * (1.0 / f))
    rem = x - qt * f
    if rem < 0:
        qt -= 1
        rem += f
    elif rem >= f:
        qt += 1
        rem -= f
    return (qt << PROB_BITS) + rem + start, n


@_kernel
def _put_uniform(x, out, n, v, nb):
    """``nb`` bits of ``v`` as uniform symbols of at most 16 bits (high part decoded
    first, so encoded last)."""
    done = 0
    take = nb - PROB_BITS * ((nb - 1) // PROB_BITS)  # the lowest piece, read last
    while done < nb:
        f = np.int64(1) << (PROB_BITS - take)
        x, n = _put(x, out, n, ((v >> done) & ((1 << take) - 1)) * f, f)
        done += take
        take = PROB_BITS
    return x, n


@_kernel
def _flush(x, out, n):
    out[n] = x & 0xFFFFFFFF
    out[n + 1] = x >> 32
    return out[: n + 2][::-1].copy()


@_kernel
def _push(starts, freqs, t, start, f):
    starts[t] = start
    freqs[t] = f
    return t + 1


@_kernel
def _push_uniform(starts, freqs, t, v, nb):
    """``nb`` bits of ``v`` as uniform symbols of at most 16 bits, high part first."""
    while nb > 0:
        take = min(nb, PROB_BITS)
        nb -= take
        f = np.int64(1) << (PROB_BITS - take)
        t = _push(starts, freqs, t, ((v >> nb) & ((1 << take) - 1)) * f, f)
    return t
