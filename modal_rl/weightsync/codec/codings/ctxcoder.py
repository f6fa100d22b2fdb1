"""Compiled kernels of the v2 chunk coding (see ``chunks_v2``): the mask model and its passes.

These run under numba (``nogil``, so the codec's thread pool runs chunks in parallel):
the model is conditioned per word, which in numpy took several full passes per chunk, and
a per-symbol coder loop must run at native speed. The rANS primitives are in
``ctxrans``, the residual model in ``ctxresidual``; this module re-exports what
``chunks_v2`` calls.

Mask model. Word ``i`` has the context ``seg(i) * 256 + e(i)``: ``e = (base >> 7) & 0xFF``
(the bfloat16 exponent of the held word) and ``seg`` its context segment (tensors, merged
up to ``SEG_MIN`` words). Per context the changes are i.i.d. with ``p = 2 ** (-q / 8)``
(``q``: one byte per context in the frame, 0 = no change there) and are coded as run
lengths in the context's own word order, the last one running to the context's end.
A geometric run length ``g`` is split as ``g = (u << m) + r`` with ``2**m`` ≈ the median
run: ``u`` (geometric, ratio ~1/2) by a static table of ``QSYM`` symbols plus an escape,
``r`` as ``m`` uniform bits (the truncated geometric within one period is close to flat:
≤ 0.03 bit per change lost).
"""

from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np

from modal_rl.weightsync.codec.codings.ctxrans import (
    PROB_BITS,
    RANS_L,
    M,
    _advance,
    _dec_uniform,
    _flush,
    _kernel,
    _put,
    _put_uniform,
    _start,
    rans_encode,
)
from modal_rl.weightsync.codec.codings.ctxresidual import res_decode_one, res_model, residual_symbols

__all__ = [
    "decode_finish",
    "decode_part",
    "decode_start",
    "encode_part",
    "mask_encode",
    "quantize_p",
    "rans_encode",
    "res_model",
    "residual_symbols",
]

SEG_MIN = 1 << 16  # tensors smaller than this share a context segment with their neighbours
QSYM = 24  # run-length quotient symbols 0..QSYM-1, then an escape
GEO_COLS = QSYM + 3  # m, then the cumulative table (QSYM + 2 entries)
NEVER = np.int32(2**31 - 1)  # countdown of a context without changes: never runs out
GAP_CAP = np.int64(1) << 30  # above any chunk's length (MAX_CHUNK_ELEMS = 2**28): corrupt


@_kernel
def _exp(word):
    """The bfloat16 exponent of a u16 word, as an unsigned index."""
    return np.uint64((word >> np.uint16(7)) & np.uint16(0xFF))


@_kernel
def _count_equal(base, new, n0, n1, uoff, i, hi):
    """Count words into their contexts from ``i`` while base and new agree; returns the
    first differing index, or ``hi``. Even and odd words count into separate arrays, so
    runs of one context make two independent store-to-load chains instead of one. Indices
    are unsigned so the compiler emits no negative-index wraparound (a third of the time)."""
    one = np.uint64(1)
    if i < hi and i & one:
        b = base[i]
        if b != new[i]:
            return i
        n1[uoff + _exp(b)] += 1
        i += one
    while i + one < hi:
        b0 = base[i]
        b1 = base[i + one]
        if b0 != new[i]:
            return i
        n0[uoff + _exp(b0)] += 1
        if b1 != new[i + one]:
            return i + one
        n1[uoff + _exp(b1)] += 1
        i += np.uint64(2)
    if i < hi:
        b = base[i]
        if b != new[i]:
            return i
        n0[uoff + _exp(b)] += 1
        i += one
    return hi


@_kernel
def encode_part(base, new, uoff, start, n0, n1, last, pos, ctxs, gaps, old_w, new_w, j):
    """Encoder pass over one part of a chunk (words ``[start, start + base.size)``, all in
    the context segment at ``uoff // 256``), continuing at change ``j``: counts words into
    their contexts (``n0`` + ``n1``), and per change records its position, context, run
    length (its context's words skipped since the previous change there, or since the
    context's start), old and new word; ``last`` = rank of each context's latest change
    (-1: none). Returns the next ``j``. Parts are passed in chunk order."""
    one = np.uint64(1)
    i = np.uint64(0)
    hi = np.uint64(base.size)
    while True:
        i = _count_equal(base, new, n0, n1, uoff, i, hi)
        if i == hi:
            return j
        c = uoff + _exp(base[i])
        r = np.int64(n0[c]) + np.int64(n1[c])
        if i & one:
            n1[c] += 1
        else:
            n0[c] += 1
        pos[j] = start + np.int64(i)
        ctxs[j] = np.int64(c)
        gaps[j] = r - last[c] - 1
        last[c] = r
        old_w[j] = base[i]
        new_w[j] = new[i]
        j += 1
        i += one


@_kernel
def quantize_p(n, last, gaps_count):
    """q byte per context: 0 without changes, else round(-8 log2(k / n)) in [1, 255]."""
    q = np.zeros(n.size, dtype=np.uint8)
    for c in range(n.size):
        if gaps_count[c] > 0:
            v = np.int64(np.round(-8.0 * np.log2(gaps_count[c] / n[c])))
            q[c] = min(255, max(1, v))
    return q


def geo_table() -> np.ndarray:
    """Per q byte (row 0 unused): the run-length model of a context with
    ``p = 2 ** (-q / 8)``: ``m``, then the cumulative table of the quotient symbols. Made
    once (a context's model depends on nothing but its q), in ``decimal``, so every machine
    gets the same table whatever its libm (a table that differed in one entry would make
    other machines' frames undecodable)."""
    tab = np.zeros((256, GEO_COLS), dtype=np.int64)
    with localcontext() as ctx:
        ctx.prec = 40
        ln2 = Decimal(2).ln()
        for q in range(1, 256):
            p = min(Decimal(2) ** (Decimal(-q) / 8), Decimal("0.999"))
            lq = (1 - p).ln()  # ln(1 - p) < 0
            m = 0
            while m < 31 and (1 << (m + 1)) * -lq <= ln2:
                m += 1
            theta = ((1 << m) * lq).exp()
            # frequencies: (1 - theta) theta^u for u < QSYM, theta^QSYM for the escape; >= 1 each
            freqs = [max(1, int(theta**u * (1 - theta) * (M - QSYM - 1))) for u in range(QSYM)]
            freqs.append(max(1, int(theta**QSYM * (M - QSYM - 1))))
            freqs[0] += M - sum(freqs)
            tab[q, 0] = m
            tab[q, 1:] = np.concatenate([[0], np.cumsum(freqs)])
    return tab


GEO = geo_table()  # a module constant: numba compiles it into the kernels


@_kernel
def _put_gap(x, out, n, g, row):
    """Run length ``g`` under the model ``row``, in reverse of the decoder's reading order."""
    m = row[0]
    u = g >> m
    x, n = _put_uniform(x, out, n, g & ((np.int64(1) << m) - 1), m)
    sym = min(u, QSYM)
    if sym == QSYM:  # escape: bit length of the excess (6 bits), then its bits
        extra = u - QSYM
        nb = 0
        while extra >> nb:
            nb += 1
        x, n = _put_uniform(x, out, n, extra, nb)
        x, n = _put_uniform(x, out, n, nb, 6)
    return _put(x, out, n, row[1 + sym], row[2 + sym] - row[1 + sym])


@_kernel
def mask_encode(n, last, ctxs, gaps, q):
    """The mask's rANS words. Reading order (the receiver's): each changed context's first
    run length (context order), then at each change (word order) its context's next run
    length, the last one to the context's end. Encoded in reverse, in one pass."""
    nch = ctxs.size
    pending = n - last - 1  # per context: the run length read after its latest change
    cap = 16 * (nch + n.size) + 64
    out = np.empty(cap, dtype=np.uint32)
    x = np.int64(RANS_L)
    w = 0
    for j in range(nch - 1, -1, -1):
        c = ctxs[j]
        x, w = _put_gap(x, out, w, pending[c], GEO[q[c]])
        pending[c] = gaps[j]
    for c in range(n.size - 1, -1, -1):
        if last[c] >= 0:
            x, w = _put_gap(x, out, w, pending[c], GEO[q[c]])
    return _flush(x, out, w)


@_kernel
def _dec_gap(x, words, w, row):
    """One run length under the model ``row`` of the geometric table (a context's q)."""
    slot = x & (M - 1)
    sym = 0
    for u in range(QSYM):  # branch-free: the table is short and the search would mispredict
        sym += row[2 + u] <= slot
    x, w = _advance(x, words, w, slot, row[1 + sym], row[2 + sym] - row[1 + sym])
    u = np.int64(sym)
    if sym == QSYM:
        nb, x, w = _dec_uniform(x, words, w, 6)
        extra = np.int64(0)
        while nb > 0:
            take = min(nb, PROB_BITS)
            nb -= take
            v, x, w = _dec_uniform(x, words, w, take)
            extra = (extra << take) | v
        u += extra
    m = row[0]  # < 32: at most two uniform pieces, the high 16 bits first
    r = np.int64(0)
    if m > PROB_BITS:
        r, x, w = _dec_uniform(x, words, w, PROB_BITS)
        m -= PROB_BITS
    if m > 0:
        v, x, w = _dec_uniform(x, words, w, m)
        r = (r << m) | v
    if u > GAP_CAP:
        u = GAP_CAP  # corrupt input; the final checks refuse it
    return min((u << row[0]) + r, GAP_CAP), x, w


@_kernel
def _scan(base, nxt, uoff, i, hi):
    """Count words down in their contexts' countdowns from ``i``; stop at the first word
    whose countdown runs out (a change) or at ``hi``. The decoder's hot loop: unsigned
    indices (no negative-index wraparound code) and int32 countdowns keep it at about
    two cycles a word."""
    while i < hi:
        c = uoff + _exp(base[i])
        r = nxt[c] - np.int32(1)
        nxt[c] = r
        if r < 0:
            return i
        i += np.uint64(1)
    return hi


@_kernel
def decode_start(q, words, rwords):
    """Decoder's state before the first word: (countdowns, ``[x, w, found, rx, rw]``:
    the mask coder's state, changes found, the residual coder's state); each context's
    first run length is read here."""
    x, w = _start(words)
    rx, rw = _start(rwords)
    # words to skip before each context's next change; int32 halves the hot loop's cost
    nxt = np.full(q.size, NEVER, dtype=np.int32)
    for c in range(q.size):
        if q[c]:
            g, x, w = _dec_gap(x, words, w, GEO[q[c]])
            nxt[c] = g
    state = np.zeros(5, dtype=np.int64)
    state[0], state[1], state[3], state[4] = x, w, rx, rw
    return nxt, state


@_kernel
def decode_part(base, uoff, start, q, words, rwords, nxt, state, model, pos, old_w, res):
    """Decoder pass over one part (as ``encode_part``), writing as it goes: each change's
    position, held word and residual are recorded and ``base`` gets the new word (one
    pass over the words, no second one over the changes). ``model``: the residual model
    (``res_model()``). Returns False on streams that cannot be this part's; ``state[2]``
    then still counts the words written, which the caller puts back from ``old_w``."""
    counts, cum, seen, nextb = model
    x, w, found, rx, rw = state[0], state[1], state[2], state[3], state[4]
    nchanged = pos.size
    i = np.uint64(0)
    hi = np.uint64(base.size)
    ok = True
    while True:
        i = _scan(base, nxt, uoff, i, hi)
        if i == hi:
            break
        if found == nchanged or w > words.size:
            ok = False
            break
        old = base[i]
        c = uoff + _exp(old)
        g, x, w = _dec_gap(x, words, w, GEO[q[c]])
        nxt[c] = g
        d, rx, rw, ok = res_decode_one(old, rwords, rx, rw, counts, cum, seen, nextb)
        if not ok:
            break
        pos[found] = start + np.int64(i)
        old_w[found] = old
        res[found] = d
        base[i] = old + d
        found += 1
        i += np.uint64(1)
    state[0], state[1], state[2], state[3], state[4] = x, w, found, rx, rw
    return ok


@_kernel
def decode_finish(q, words, rwords, nxt, state, nchanged):
    """Whether the chunk decoded exactly: every run ended at its context's end, every
    change and every word of both streams was read, and both coders are back in their
    initial state."""
    for c in range(q.size):
        if q[c] and nxt[c] != 0:
            return False
    mask_done = state[2] == nchanged and state[1] == words.size and state[0] == RANS_L
    return mask_done and state[4] == rwords.size and state[3] == RANS_L
