"""What a v2 chunk costs a receiver beyond a v1 chunk: measured there, told to the publisher.

Coding for time (``chunks_v2.v2_pays``) weighs the wire time a v2 body saves against the
extra decode time it costs the receiver: a pass over every held word of the chunk, and more
work per change. Those costs belong to the receiver's CPU, not the trainer's, so each
receiver measures them once (during its warm-up, ``measure``; publishers do not) and
names them in its hello (``{"decode": {"word_s": …, "change_s": …}}``, covered by the
handshake's proof); a frame
server codes for its slowest receiver (``slowest``). A receiver that has not measured yet,
or an old one, counts at the defaults, which were measured on the real Adam band.

Invariant: these numbers only ever choose between two lossless codings; a wrong or hostile
value costs time, never correctness, and out-of-range values are ignored (``from_hello``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

WORDS = 1 << 20  # the probe chunk: ~1 ms of v2 pass on a small host
DENSITY = 0.01  # changes in the probe (the real band: 0.6-1.1%)
REPEATS = 3
MAX_WORD_S = 1e-6  # hello values above these are not a CPU, they are a mistake (or a lie)
MAX_CHANGE_S = 1e-4


@dataclass(frozen=True)
class DecodeCosts:
    """Seconds a v2 chunk costs one decode thread beyond v1: per held word of the chunk,
    and per changed word."""

    word_s: float
    change_s: float

    def hello(self) -> dict[str, float]:
        return {"word_s": self.word_s, "change_s": self.change_s}


DEFAULT = DecodeCosts(word_s=1.0e-9, change_s=50e-9)
_measured: list[DecodeCosts] = []  # this process's own, once measured


def from_hello(value) -> DecodeCosts | None:
    """The costs a hello names, or None when it names none or values out of range."""
    if not isinstance(value, dict):
        return None
    word_s, change_s = value.get("word_s"), value.get("change_s")
    for v, top in ((word_s, MAX_WORD_S), (change_s, MAX_CHANGE_S)):
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or not 0 <= v <= top:
            return None
    return DecodeCosts(float(word_s), float(change_s))


def slowest(costs: list[DecodeCosts | None]) -> DecodeCosts:
    """The costs to code for: the largest of each, a receiver without its own at ``DEFAULT``."""
    known = [c or DEFAULT for c in costs] or [DEFAULT]
    return DecodeCosts(max(c.word_s for c in known), max(c.change_s for c in known))


def measured() -> DecodeCosts | None:
    """This process's measured costs (None before ``measure`` ran)."""
    return _measured[0] if _measured else None


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
    from modal_rl.weightsync import chunks_v2
    from modal_rl.weightsync.chunks import (
        CHUNK_HEADER,
        CTX_SPARSE,
        XOR_SPARSE,
        ChunkSpec,
        decode_chunk,
        encode_delta_chunk,
    )
    from modal_rl.weightsync.diffwords import diff_words
    from modal_rl.weightsync.scatter import scatter

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
    costs = DecodeCosts(min(word_s, MAX_WORD_S), min(change_s, MAX_CHANGE_S))
    _measured[:] = [costs]
    return costs
