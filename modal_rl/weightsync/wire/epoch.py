"""Epochs: which start of a trainer published a frame, and how receivers order them.

Every frame's version header names the publishing **run** (``run_id``: a public fingerprint
of the run key, so a restarted trainer of the same run has the same id) and an **epoch**, a
64-bit number a trainer draws when it starts: the start time in milliseconds in the high 44
bits and 20 random bits below, so two starts never share one and a later start has a larger
number. A store's lease makes epochs strictly increasing whatever the clocks say
(``new_epoch(after=...)``); over TCP the order relies on the hosts' clocks agreeing to within
a trainer's restart time (seconds; Modal hosts keep NTP time).

Receivers order what they hold by ``position = (epoch, version)``, lexicographically: a newer
epoch wins whatever its version (a trainer restarted from a checkpoint at version 3 replaces
one that reached 7), an older epoch is refused, and within an epoch versions increase.
"""

from __future__ import annotations

import datetime
import secrets
import time

RANDOM_BITS = 20
MAX_EPOCH = (1 << 64) - 1


def new_epoch(after: int | None = None) -> int:
    """A fresh epoch, greater than ``after`` when given (a store's previous epoch)."""
    epoch = (time.time_ns() // 1_000_000) << RANDOM_BITS | secrets.randbits(RANDOM_BITS)
    if after is not None and epoch <= after:
        epoch = after + 1 + secrets.randbits(8)
    if not 0 < epoch <= MAX_EPOCH:
        raise ValueError(f"epoch {epoch} out of range")
    return epoch


def started_at(epoch: int) -> float:
    """The epoch's start time (seconds since 1970) as its trainer's clock read it."""
    return (epoch >> RANDOM_BITS) / 1000.0


def describe(epoch: int | None) -> str:
    """``<hex> (started <UTC time>)`` for messages; epoch 0 is the codec's unstamped frames."""
    if epoch is None:
        return "none"
    if epoch == 0:
        return "0 (unstamped)"
    when = datetime.datetime.fromtimestamp(started_at(epoch), datetime.UTC)
    return f"{epoch:016x} (started {when:%Y-%m-%d %H:%M:%S} UTC)"


def position(epoch: int | None, version: int | None) -> tuple[int, int]:
    """The order receivers keep: (epoch, version); nothing held sorts first."""
    return (-1 if epoch is None else epoch, -1 if version is None else version)
