"""Many tensors' ls128 sums as two uint64 lane arrays, and their hex and digest in bulk.

A sum's hex (``linsum``) is lane a then lane c, 16 hex digits each; ``add_sums`` adds lane by
lane mod 2^64. Holding a whole state's sums as two arrays lets a delta's moves be added with
one numpy call per chunk, and the ``state_digest`` of every sum be hashed from one buffer
made by array writes — no Python per tensor on a version's path.

Invariant: ``to_hex(from_hex(s)) == s`` for lower-case sums, and ``SortedDigest.digest``
equals ``frames.state_digest`` of the same names and sums, byte for byte (one xxh3-128
over the same bytes: a streamed hash does not depend on how its input is split).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

# each byte's two hex digits as one 2-byte word (in memory order): one gather per byte
_HEX_PAIRS = np.frombuffer(b"".join(f"{i:02x}".encode() for i in range(256)), np.uint16)


def from_hex(sums: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(lane a, lane c) of hex sums (once per layout: this is Python per sum)."""
    a = np.array([int(s[:16], 16) for s in sums], np.uint64)
    c = np.array([int(s[16:], 16) for s in sums], np.uint64)
    return a, c


def hex_bytes(a: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The sums as an (n, 32) array of ASCII hex digits."""
    both = np.empty((a.size, 2), ">u8")
    both[:, 0], both[:, 1] = a, c
    return _HEX_PAIRS[both.view(np.uint8)].view(np.uint8).reshape(a.size, 32)


def to_hex(a: np.ndarray, c: np.ndarray) -> list[str]:
    """The sums as ``linsum`` hex strings."""
    text = hex_bytes(a, c).tobytes().decode("ascii")
    return [text[i : i + 32] for i in range(0, len(text), 32)]


def add(a: np.ndarray, c: np.ndarray, at: np.ndarray, move_a: np.ndarray, move_c: np.ndarray) -> None:
    """Lanes ``at`` (distinct) moved by ``(move_a, move_c)``, mod 2^64, in place."""
    a[at] += move_a
    c[at] += move_c


class SortedDigest:
    """``state_digest`` of a fixed set of names with changing sums: the hashed text (each
    name, a NUL, its 32-digit sum, a newline, in sorted name order) is laid out once; a
    digest writes the sums' digits into their slots and hashes the buffer once."""

    def __init__(self, names: Sequence[str]) -> None:
        order = sorted(range(len(names)), key=names.__getitem__)
        parts, slots, at = [], np.empty(len(names), np.int64), 0
        for k, i in enumerate(order):
            prefix = names[i].encode() + b"\0"
            parts.append(prefix + b"0" * 32 + b"\n")
            slots[k] = at + len(prefix)
            at += len(prefix) + 33
        self.order = np.array(order, np.int64)
        self.buffer = np.frombuffer(b"".join(parts), np.uint8).copy()
        self.index = (slots[:, None] + np.arange(32)).reshape(-1)

    def digest(self, a: np.ndarray, c: np.ndarray) -> str:
        digits = hex_bytes(a[self.order], c[self.order])
        self.buffer[self.index] = digits.reshape(-1)
        return xxhash.xxh3_128(self.buffer).hexdigest()
