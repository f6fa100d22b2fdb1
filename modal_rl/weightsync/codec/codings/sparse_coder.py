"""The v1 sparse coder in one compiled pass: gap bytes, gap exceptions and the residual
byte planes written straight into one output buffer, then entropy-coded slice by slice.

The numpy coder made a dozen passes over the changes (a strided sample per residual kind
and a bincount per plane to pick the residual, ``np.diff``, ``minimum``, a cast, a masked
gather for the exceptions, the residual, a strided copy per byte plane, a count per plane
for the coder choice), each through its own temporary. ``_code`` reads each change once and
writes its gap byte, its exception (a gap of 255 or more, as four bytes), the bytes of both
residuals (XOR and SUB) into their planes and, over the strided sample the numpy coder's
residual choice uses (``SAMPLE``), both residuals' byte histograms. The choice is then
``choose_kind``'s integer sums over the same counts (``_choose``), so it never differs from
the numpy coder's (writing the planes of both kinds costs less than a second pass over the
changes); the coder choice
(``streams.pick_coder``) needs only the chosen planes' nonzero counts (``np.count_nonzero``:
a vectorized scan, not a counter per byte in the loop).

Layout of the buffer (n changes, w bytes a word): gap bytes (n), XOR planes (w × n), SUB
planes (w × n), exception planes (4 × n reserved: ``np.empty`` touches only the pages
written). The streams handed to ``pack_streams`` are slices of it in the wire's order, so the
body is byte-identical to the numpy coder's (``chunks.encode_delta_chunk`` keeps that path
where numba is missing).

Invariant: for the same changes and level, ``chunks.encode_delta_chunk`` writes the same
bytes with and without this coder; positions are strictly increasing, chunk-local.
"""

from __future__ import annotations

import numpy as np

from modal_rl.weightsync.codec.jit import Kernel
from modal_rl.weightsync.codec.streams import ZSTD

# The residual choice's sample, for both coders (``chunks.choose_residual``): every
# change's bytes counted cost the pass ~1 ns of its ~3 per change, and 4096 changes tell the
# two residuals' entropies apart as well as all of them do on the real trajectories.
SAMPLE = 1 << 12
ESCAPE = 255


def _code(positions, old, new, step, itemsize, mask, out, hist):
    """One pass over the changes: each change's gap byte (and its exception, for a gap of
    255 or more), both residuals' bytes into their planes, and, for every ``step``-th change, both residuals' bytes into ``hist[kind, plane, lane]``
    (four lanes in turn, so that runs of one byte value do not wait on one counter).
    Layout in the module doc; kind 0 = XOR, 1 = SUB. Returns the number of exceptions."""
    n = positions.size
    top_shift = np.uint64(8 * itemsize - 1)
    one = np.uint64(1)
    xor_at = n
    sub_at = n + itemsize * n
    exc_at = n + 2 * itemsize * n
    nexc = 0
    prev = -1
    until_sample = 0  # changes before the next sampled one (no division in the loop)
    lane = 3
    for i in range(n):
        p = positions[i]
        gap = p - prev - 1
        prev = p
        if gap >= ESCAPE:
            out[i] = ESCAPE
            e = gap - ESCAPE
            out[exc_at + nexc] = e & 0xFF
            out[exc_at + n + nexc] = (e >> 8) & 0xFF
            out[exc_at + 2 * n + nexc] = (e >> 16) & 0xFF
            out[exc_at + 3 * n + nexc] = (e >> 24) & 0xFF
            nexc += 1
        else:
            out[i] = gap
        u = np.uint64(old[i])
        v = np.uint64(new[i])
        x = u ^ v
        # zigzag(v - u) in the word's width, on uint64 (numba widens small words: wrap by mask)
        d = (v - u) & mask
        z = ((d << one) ^ (mask * ((d >> top_shift) & one))) & mask
        sampled = until_sample == 0
        if sampled:
            until_sample = step
            lane = (lane + 1) & 3
        until_sample -= 1
        for k in range(itemsize):
            s = np.uint64(8 * k)
            bx = (x >> s) & np.uint64(0xFF)
            bz = (z >> s) & np.uint64(0xFF)
            out[xor_at + k * n + i] = bx
            out[sub_at + k * n + i] = bz
            if sampled:
                hist[0, k, lane, np.int64(bx)] += 1
                hist[1, k, lane, np.int64(bz)] += 1
    return nexc


def _code2(positions, old, new, step, out, hist):
    """``_code`` for 2-byte words, unrolled (the common case: bf16 and fp16 states)."""
    n = positions.size
    nexc = 0
    prev = -1
    until_sample = 0
    lane = 3
    xor_at = n
    sub_at = 3 * n
    exc_at = 5 * n
    for i in range(n):
        p = positions[i]
        gap = p - prev - 1
        prev = p
        if gap >= ESCAPE:
            out[i] = ESCAPE
            e = gap - ESCAPE
            out[exc_at + nexc] = e & 0xFF
            out[exc_at + n + nexc] = (e >> 8) & 0xFF
            out[exc_at + 2 * n + nexc] = (e >> 16) & 0xFF
            out[exc_at + 3 * n + nexc] = (e >> 24) & 0xFF
            nexc += 1
        else:
            out[i] = gap
        u = np.int64(old[i])
        v = np.int64(new[i])
        x = u ^ v
        d = (v - u) & 0xFFFF
        z = ((d << 1) ^ (0xFFFF * (d >> 15))) & 0xFFFF
        x0, x1, z0, z1 = x & 0xFF, x >> 8, z & 0xFF, z >> 8
        out[xor_at + i] = x0
        out[xor_at + n + i] = x1
        out[sub_at + i] = z0
        out[sub_at + n + i] = z1
        if until_sample == 0:
            until_sample = step
            lane = (lane + 1) & 3
            hist[0, 0, lane, x0] += 1
            hist[0, 1, lane, x1] += 1
            hist[1, 0, lane, z0] += 1
            hist[1, 1, lane, z1] += 1
        until_sample -= 1
    return nexc


CODE = Kernel(_code)
CODE2 = Kernel(_code2)


def available() -> bool:
    return CODE.get() is not None and CODE2.get() is not None and CHOOSE.get() is not None


def _mask(itemsize: int) -> np.uint64:
    return np.uint64((1 << (8 * itemsize)) - 1)


def clogc_table(sample: int) -> np.ndarray:
    """``c·log2(c)`` in units of 2**-16 bits, rounded to int64, for every count a sample of
    ``sample`` can give: a strided sample of a chunk's changes has fewer than ``2·sample``
    (``n // step < 2·sample`` for ``step = max(1, n // sample)``). Integers, so that the
    compiled and numpy coders' sums are equal in any order."""
    table = _TABLES.get(sample)
    if table is None:
        c = np.arange(2 * sample + 1, dtype=np.float64)
        table = _TABLES[sample] = np.rint(c * np.log2(np.maximum(c, 1)) * 65536).astype(np.int64)
    return table


_TABLES: dict[int, np.ndarray] = {}


def choose_kind(counts: np.ndarray) -> int:
    """0 (XOR) or 1 (SUB): the kind whose byte planes have the smaller order-0 entropy,
    from their byte counts ``counts[kind, plane, value]`` over a sample of ``SAMPLE``
    (ties go to XOR): the numpy coder's rule (``chunks.choose_residual``); ``_choose`` is
    the same sums in the compiled pass. A plane's entropy is ``size·log2(size) − Σ c·log2(c)``
    bits over ``size`` sampled changes, and both kinds have as many planes: the larger
    ``Σ c·log2(c)`` wins."""
    table = clogc_table(SAMPLE)
    terms = table[np.minimum(counts, table.size - 1)].sum(axis=(1, 2))
    return 0 if terms[0] >= terms[1] else 1


def _choose(hist, table):
    """``choose_kind`` over ``hist[kind, plane, lane, value]`` (the lanes summed first)."""
    top = table.size - 1
    sums = np.zeros(2, np.int64)
    for kind in range(2):
        for k in range(hist.shape[1]):
            for v in range(256):
                c = hist[kind, k, 0, v] + hist[kind, k, 1, v] + hist[kind, k, 2, v] + hist[kind, k, 3, v]
                sums[kind] += table[min(c, top)]
    return 0 if sums[0] >= sums[1] else 1


CHOOSE = Kernel(_choose)


def _coder(nonzero: int, size: int, noisy: int) -> int:
    # ``streams.pick_coder(plane, noisy)`` from a plane's nonzero count
    if size < 64:
        return ZSTD
    return noisy if nonzero * 2 > size else ZSTD


def encode_sparse(positions: np.ndarray, old: np.ndarray, new: np.ndarray, noisy: int):
    """(residual kind, streams, their coders) of a sparse chunk body for the changes: the
    kind ``chunks.choose_residual`` picks, and the streams in the wire's order, ready for
    ``pack_streams`` (slices of one buffer: nothing is copied again); ``noisy`` is the
    coder of noisy residual planes (``chunks.SPARSE_NOISY``)."""
    n, itemsize = int(positions.size), old.dtype.itemsize
    out = np.empty(n * (1 + 2 * itemsize + 4), np.uint8)
    step = max(1, n // SAMPLE)
    hist = np.zeros((2, itemsize, 4, 256), np.int64)
    positions = positions.astype(np.int64, copy=False)
    if itemsize == 2:
        nexc = CODE2.get()(positions, old, new, np.int64(step), out, hist)
    else:
        nexc = CODE.get()(positions, old, new, np.int64(step), itemsize, _mask(itemsize), out, hist)
    kind = CHOOSE.get()(hist, clogc_table(SAMPLE))
    exc_at = n + 2 * itemsize * n
    streams = [out[:n]] + [out[exc_at + k * n : exc_at + k * n + nexc] for k in range(4)]
    at = n + kind * itemsize * n
    streams += [out[at + k * n : at + (k + 1) * n] for k in range(itemsize)]
    coders = [ZSTD] * 5 + [_coder(np.count_nonzero(plane), n, noisy) for plane in streams[5:]]
    return ("xor" if kind == 0 else "sub"), streams, coders
