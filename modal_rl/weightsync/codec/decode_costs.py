"""What a v2 chunk costs a receiver beyond a v1 chunk: measured there, told to the publisher.

Coding for time (``chunks_v2.v2_pays``) weighs the wire time a v2 body saves against the
extra decode time it costs the receiver: a pass over every held word of the chunk, and more
work per change. Those costs belong to the receiver's CPU, not the trainer's, so each
receiver measures them once (during its warm-up, ``decode_probe.measure``; publishers do not) and
names them in its hello (``{"decode": {"word_s": …, "change_s": …}}``, covered by the
handshake's proof); a frame
server codes for its slowest receiver (``slowest``). A receiver that has not measured yet,
or an old one, counts at the defaults, which were measured on the real Adam band.

Invariant: these numbers only ever choose between two lossless codings; a wrong or hostile
value costs time, never correctness, and out-of-range values are ignored (``from_hello``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    """This process's measured costs (None before ``decode_probe.measure`` ran)."""
    return _measured[0] if _measured else None


def keep(costs: DecodeCosts) -> None:
    """Remember this process's measured costs (``decode_probe.measure``) for ``measured``."""
    _measured[:] = [costs]
