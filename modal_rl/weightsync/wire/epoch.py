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
An epoch whose start lies beyond the reader's clock plus ``MAX_CLOCK_SKEW_S`` is refused
wherever it is claimed (``from_the_future``): it could only hold later starts below it.
"""

from __future__ import annotations

import datetime
import secrets
import time

RANDOM_BITS = 20
MAX_EPOCH = (1 << 64) - 1
# How far ahead of a reader's clock a signed claim's time (an epoch's start, a record's
# ``at``) may be: hosts keep NTP time, so more is a claim to refuse, not a clock to trust.
MAX_CLOCK_SKEW_S = 300.0


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


def from_the_future(epoch: int, now: float | None = None) -> bool:
    """Whether ``epoch`` claims a start beyond ``now`` (default: this clock) plus
    ``MAX_CLOCK_SKEW_S``: no trainer drew it yet (say 2**64-1, which would hold every later
    epoch below it). Epoch 0, the unstamped one, is not."""
    now = time.time() if now is None else now
    return started_at(epoch) > now + MAX_CLOCK_SKEW_S


def describe(epoch: int | None) -> str:
    """``<hex> (started <UTC time>)`` for messages; epoch 0 is the codec's unstamped frames."""
    if epoch is None:
        return "none"
    if epoch == 0:
        return "0 (unstamped)"
    try:
        when = datetime.datetime.fromtimestamp(started_at(epoch), datetime.UTC)
    except (OverflowError, ValueError, OSError):  # a claimed epoch no calendar reaches
        return f"{epoch:016x} (a start beyond any date)"
    return f"{epoch:016x} (started {when:%Y-%m-%d %H:%M:%S} UTC)"


def position(epoch: int | None, version: int | None) -> tuple[int, int]:
    """The order receivers keep: (epoch, version); nothing held sorts first."""
    return (-1 if epoch is None else epoch, -1 if version is None else version)
