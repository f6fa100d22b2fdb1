"""The ``RANS0`` stream method: a static order-0 byte model, rANS-coded, table in the stream.

Why: a v1 sparse chunk's noisy residual plane (the low byte of the SUB residual, most
changes being one or two ulps) is skewed enough that any Huffman code loses a fraction of a
bit per byte (Huffman-only DEFLATE was 12% above the plane's order-0 entropy on the real
Adam trajectory) and zlib spends ~6 ns a byte getting there. rANS codes within a table's
bytes of the entropy, in one compiled pass, with no per-block tables.

Payload (what follows the stream header's method, raw length and stored length):

- a 32-byte bitmap: bit ``s & 7`` of byte ``s >> 3`` set when byte value ``s`` has a
  frequency;
- each such value's frequency, in increasing value order, as a LEB128 varint of at most two
  bytes, every one in ``[1, M - 1]`` and all summing to ``M = 2**PROB_BITS``;
- ``LANES`` coder states, u64 little-endian, each in ``[RANS_L, 2**63)``;
- the coder's words, u32 little-endian, in the order the decoder reads them.

Byte ``i`` of the stream is coded by lane ``i % LANES`` (independent states, so the
encoder's and decoder's dependency chains interleave). States live in ``[RANS_L, 2**63)``
and are renormalised 32 bits at a time: before a symbol of frequency ``f`` is coded its lane
sheds a word if it is ``f << (63 - PROB_BITS)`` or more (at most one word a symbol), which
keeps every product below ``2**63`` (int64 throughout).

Invariants: the decoder reads only inside the payload and writes only the ``raw_len``
bytes it is given room for (the caller bounds ``raw_len``); it succeeds only when the table
is well formed, every word is consumed and every lane ends in the encoder's initial state —
anything else is a refusal (``decode`` returns None), never an exception. This module
imports numba: ``streams`` imports it only where a stream is coded or decoded this way.
"""

from __future__ import annotations

import numpy as np
from numba import njit

PROB_BITS = 12
M = 1 << PROB_BITS
RANS_L = 1 << 31
LANES = 4
BITMAP = 32
TABLE_MAX = BITMAP + 2 * 256
STATES = 8 * LANES
RENORM_SHIFT = 63 - PROB_BITS  # a state of ``f << RENORM_SHIFT`` or more sheds a word first

_kernel = njit(nogil=True, cache=True)


@_kernel
def _encode(data, out, out32):
    """Code ``data`` (u8) into the tail of ``out`` (u8; ``out32`` is its u32 view, 4-byte
    aligned, ``out.size`` a multiple of 4): returns the payload's start in ``out`` (it ends
    at ``out.size``), or -1 when ``out`` is too small. Words are written backwards from the
    end (rANS encodes in reverse), then the states and the table in front of them."""
    n = data.size
    counts = np.zeros((4, 256), np.int64)
    k = 0
    while k + 4 <= n:  # four histograms: runs of one value do not wait on one counter
        counts[0, data[k]] += 1
        counts[1, data[k + 1]] += 1
        counts[2, data[k + 2]] += 1
        counts[3, data[k + 3]] += 1
        k += 4
    while k < n:
        counts[0, data[k]] += 1
        k += 1
    total = np.zeros(256, np.int64)
    for s in range(256):
        total[s] = counts[0, s] + counts[1, s] + counts[2, s] + counts[3, s]
    freqs = _normalize(total, n)
    starts = np.zeros(256, np.int64)
    xmax = np.zeros(256, np.int64)
    rcp = np.zeros(256, np.float64)
    acc = 0
    for s in range(256):
        starts[s] = acc
        acc += freqs[s]
        if freqs[s] > 0:
            xmax[s] = freqs[s] << RENORM_SHIFT
            rcp[s] = 1.0 / freqs[s]
    w = out32.size  # next word goes to w - 1
    x0 = x1 = x2 = x3 = np.int64(RANS_L)
    i = n - 1
    # the tail first, so that the unrolled loop starts at a lane-3 symbol
    while i >= 0 and (i & 3) != 3:
        lane = i & 3
        x, w = _put(_lane(lane, x0, x1, x2), data[i], out32, w, freqs, starts, xmax, rcp)
        x0, x1, x2 = _with_lane(lane, x, x0, x1, x2)
        i -= 1
    floor = (TABLE_MAX + STATES) // 4 + 4  # keep room in front for the states and table
    while i >= 3:
        if w < floor + 4:
            return -1
        x3, w = _put(x3, data[i], out32, w, freqs, starts, xmax, rcp)
        x2, w = _put(x2, data[i - 1], out32, w, freqs, starts, xmax, rcp)
        x1, w = _put(x1, data[i - 2], out32, w, freqs, starts, xmax, rcp)
        x0, w = _put(x0, data[i - 3], out32, w, freqs, starts, xmax, rcp)
        i -= 4
    at = 4 * w - STATES
    if at < TABLE_MAX:
        return -1
    _put_u64(out, at, x0)
    _put_u64(out, at + 8, x1)
    _put_u64(out, at + 16, x2)
    _put_u64(out, at + 24, x3)
    table = np.zeros(TABLE_MAX, np.uint8)
    t = BITMAP
    for s in range(256):
        f = freqs[s]
        if f > 0:
            table[s >> 3] |= np.uint8(1 << (s & 7))
            if f >= 128:
                table[t] = (f & 0x7F) | 0x80
                table[t + 1] = f >> 7
                t += 2
            else:
                table[t] = f
                t += 1
    at -= t
    for j in range(t):
        out[at + j] = table[j]
    return at


@_kernel
def _lane(lane, x0, x1, x2):
    """The state of ``lane`` (0, 1 or 2) among the first three: the tail of a length that is
    not a multiple of 4 never reaches lane 3."""
    return x0 if lane == 0 else x1 if lane == 1 else x2


@_kernel
def _with_lane(lane, x, x0, x1, x2):
    """``(x0, x1, x2)`` with ``lane``'s state replaced by ``x``."""
    if lane == 0:
        return x, x1, x2
    if lane == 1:
        return x0, x, x2
    return x0, x1, x


@_kernel
def _put(x, s, out32, w, freqs, starts, xmax, rcp):
    """Code symbol ``s`` onto state ``x`` (its word, if one is shed, at ``w - 1``)."""
    f = freqs[s]
    if x >= xmax[s]:
        w -= 1
        out32[w] = x & 0xFFFFFFFF
        x >>= 32
    # x < f << 51, so the quotient has < 52 bits: the float estimate is off by at most 1
    q = np.int64(x * rcp[s])
    r = x - q * f
    if r < 0:
        q -= 1
        r += f
    elif r >= f:
        q += 1
        r -= f
    return (q << PROB_BITS) + r + starts[s], w


@_kernel
def _put_u64(out, at, x):
    for b in range(8):
        out[at + b] = (x >> (8 * b)) & 0xFF


@_kernel
def _normalize(counts, n):
    """Frequencies summing to ``M``, each present value at least 1 and none above
    ``M - 1`` (a lone value shares the table with one absent neighbour: a state then
    never reaches ``M << RENORM_SHIFT``, which would overflow)."""
    freqs = np.zeros(256, np.int64)
    best = -1
    present = 0
    total = 0
    for s in range(256):
        c = counts[s]
        if c == 0:
            continue
        present += 1
        f = (c * M + n // 2) // n
        if f < 1:
            f = 1
        freqs[s] = f
        total += f
        if best < 0 or c > counts[best]:
            best = s
    if present == 0:
        return freqs
    if present == 1:
        freqs[best] = M - 1
        freqs[(best + 1) & 255] = 1
        return freqs
    surplus = total - M
    if surplus <= 0 or freqs[best] - surplus >= (freqs[best] + 1) // 2:
        freqs[best] -= surplus  # the commonest value absorbs the rounding
        return freqs
    while surplus > 0:  # rounding pushed many rare values up: take one from each in turn
        for s in range(256):
            if surplus > 0 and freqs[s] > 1:
                freqs[s] -= 1
                surplus -= 1
    return freqs


@_kernel
def _decode(payload, out):
    """Decode ``payload`` into all of ``out`` (u8): True only for a well-formed payload
    that ends exactly (see the module doc); reads and writes stay in bounds either way."""
    size = payload.size
    if size < BITMAP + STATES:
        return False
    freqs = np.zeros(256, np.int64)
    starts = np.zeros(256, np.int64)
    t = BITMAP
    acc = 0
    for s in range(256):
        if payload[s >> 3] & (1 << (s & 7)):
            if t >= size:
                return False
            f = np.int64(payload[t])
            t += 1
            if f & 0x80:
                if t >= size or payload[t] >= 0x80:
                    return False
                f = (f & 0x7F) | (np.int64(payload[t]) << 7)
                t += 1
            if f < 1 or f >= M:
                return False
            freqs[s] = f
            starts[s] = acc
            acc += f
            if acc > M:
                return False
    if acc != M or t + STATES > size or (size - t - STATES) % 4 != 0:
        return False
    lut = np.empty(M, np.uint8)
    for s in range(256):
        for slot in range(starts[s], starts[s] + freqs[s]):
            lut[slot] = s
    xs = np.zeros(LANES, np.int64)
    for lane in range(LANES):
        x = np.int64(0)
        for b in range(8):
            x |= np.int64(payload[t + 8 * lane + b]) << (8 * b)
        if x < RANS_L:  # also a state of 2**63 or more: it reads back negative
            return False
        xs[lane] = x
    w = t + STATES
    x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
    n = out.size
    i = 0
    while i + 4 <= n:
        x0, w, s = _get(x0, payload, w, lut, freqs, starts)
        out[i] = s
        x1, w, s = _get(x1, payload, w, lut, freqs, starts)
        out[i + 1] = s
        x2, w, s = _get(x2, payload, w, lut, freqs, starts)
        out[i + 2] = s
        x3, w, s = _get(x3, payload, w, lut, freqs, starts)
        out[i + 3] = s
        i += 4
        if w > size:  # out of words: refused now, not after ``raw_len`` more symbols
            return False
    while i < n:
        lane = i & 3
        x, w, s = _get(_lane(lane, x0, x1, x2), payload, w, lut, freqs, starts)
        out[i] = s
        x0, x1, x2 = _with_lane(lane, x, x0, x1, x2)
        i += 1
    # a word read past the end counts as a read (``w`` > size): the payload is refused
    return w == size and x0 == RANS_L and x1 == RANS_L and x2 == RANS_L and x3 == RANS_L


@_kernel
def _get(x, payload, w, lut, freqs, starts):
    """One symbol off state ``x``; a word is read at ``w`` when the state runs low (past
    the payload's end it reads as zero, and ``w`` still moves on, so the end check fails)."""
    slot = x & (M - 1)
    s = lut[slot]
    x = freqs[s] * (x >> PROB_BITS) + slot - starts[s]
    if x < RANS_L:
        word = np.int64(0)
        if w + 4 <= payload.size:
            word = (
                np.int64(payload[w])
                | (np.int64(payload[w + 1]) << 8)
                | (np.int64(payload[w + 2]) << 16)
                | (np.int64(payload[w + 3]) << 24)
            )
        x = (x << 32) | word
        w += 4
    return x, w, s


def encode(data: np.ndarray) -> memoryview | None:
    """The payload coding ``data`` (u8, contiguous), or None where it would not be smaller
    than ``data`` itself (the caller then stores the stream)."""
    n = int(data.size)
    cap = -(-(n + TABLE_MAX + STATES + 64) // 4) * 4
    out = np.empty(cap, np.uint8)
    at = _encode(data, out, out.view(np.uint32))
    if at < 0 or cap - at >= n:
        return None
    return memoryview(out[at:])


def decode(payload: memoryview | bytes, raw_len: int) -> np.ndarray | None:
    """The ``raw_len`` bytes ``payload`` codes, or None for a payload that is not a
    well-formed ``RANS0`` stream of that length. ``raw_len`` is the caller's to bound."""
    out = np.empty(raw_len, np.uint8)
    ok = _decode(np.frombuffer(payload, np.uint8), out)
    return out if ok else None
