"""A receiver's measurement of its own decode costs (``decode_costs``): probe chunks decoded
with both codings, once per process, during its warm-up (~40 ms). Apart from the cost values
because it needs the codec, and the codec needs the values.
"""

from __future__ import annotations

import math
import time

import numpy as np

from modal_rl.weightsync.codec import decode_costs
from modal_rl.weightsync.codec.decode_costs import DecodeCosts

WORDS = 1 << 20  # the probe chunk: ~1 ms of v2 pass on a small host
DENSITY = 0.01  # changes in the probe (the real band: 0.6-1.1%)
REPEATS = 3


def _probe(changes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Held words with the real band's exponents, and a version where ``changes`` of them
    moved by the ±1-2 ulp steps Adam makes."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0x3A00, 0x3F00, WORDS, dtype=np.int64).astype(np.uint16)
    new = base.copy()
    where = np.sort(rng.choice(WORDS, changes, replace=False))
    new[where] += rng.choice(np.array([1, 2, 0xFFFF, 0xFFFE], np.uint16), changes)
    return base, new


def _best(fn) -> float:
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _decode_times(changes: int, seed: int) -> tuple[float, float]:
    """(v1, v2) seconds to decode and write one probe chunk, best of ``REPEATS``."""
    from modal_rl.weightsync.codec.codings import chunks_v2
    from modal_rl.weightsync.codec.codings.chunks import (
        CHUNK_HEADER,
        CTX_SPARSE,
        XOR_SPARSE,
        ChunkSpec,
        decode_chunk,
        encode_delta_chunk,
    )
    from modal_rl.weightsync.codec.diffwords import diff_words
    from modal_rl.weightsync.codec.scatter import scatter

    base, new = _probe(changes, seed)
    positions, old, new_w = diff_words(base, new)
    v1 = encode_delta_chunk(ChunkSpec(0, 0, WORDS), positions, old, new_w, 3)

    def header(k: int) -> bytes:
        return CHUNK_HEADER.pack(0, WORDS, k, CTX_SPARSE, chunks_v2.CTX_STREAMS)

    v2 = chunks_v2.encode(header, [base], [new], [0], 3)[0]
    held = base.copy()

    def decode_v1() -> None:
        chunk = decode_chunk(v1, 2, WORDS)
        scatter(held, chunk.positions, 0, chunk.values, "xor" if chunk.encoding == XOR_SPARSE else "add")
        held[:] = base  # as v2's copy below: both timings include it

    def decode_v2() -> None:
        chunks_v2.decode(memoryview(v2), 0, WORDS, changes, [held], [0])
        held[:] = base

    return _best(decode_v1), _best(decode_v2)


def measure() -> DecodeCosts:
    """Measure this CPU's costs on probe chunks (~40 ms; the kernels must be loadable) and
    keep them for ``measured``. Two probes, one change and ``DENSITY``: the first gives the
    per-word pass, their difference the per-change work."""
    k = int(WORDS * DENSITY)
    v1_one, v2_one = _decode_times(1, seed=1)
    v1_k, v2_k = _decode_times(k, seed=2)
    word_s = max(0.0, (v2_one - v1_one) / WORDS)
    change_s = max(0.0, ((v2_k - v2_one) - (v1_k - v1_one)) / (k - 1))
    costs = DecodeCosts(min(word_s, decode_costs.MAX_WORD_S), min(change_s, decode_costs.MAX_CHANGE_S))
    decode_costs.keep(costs)
    return costs
