"""Transport port: how frames move from one publisher to many subscribers.

Two implementations, one file each: ``transport_tcp`` (a frame server on the trainer,
streaming to receivers over plain TCP with fan-out, back-pressure, a rate limit and
resume) and ``transport_store`` (publish/subscribe through a directory, or a Modal Volume
with commit/reload). Both carry frames exactly as ``codec`` writes them; neither trusts
them — the subscriber's ``VersionChain`` verifies every frame.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from modal_rl import ratelimit
from modal_rl.weightsync.frames import VersionHeader


class FrameSink(Protocol):
    """Publisher side of a transport."""

    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """Deliver one frame's records, in order, as they are produced (so encoding and
        sending overlap). Returns the frame's size in bytes. When it returns, the frame is
        durable (store) or queued to every connected receiver (tcp)."""

    def close(self) -> None: ...


class FrameSource(Protocol):
    """Subscriber side of a transport."""

    def next_frame(self, have_version: int | None, timeout: float | None = None) -> bytes | None:
        """The next frame a receiver at ``have_version`` needs (an anchor if it has nothing
        or fell behind the retained deltas), or None if none arrived within ``timeout``."""

    def close(self) -> None: ...


class TokenBucket(ratelimit.TokenBucket):
    """The project's token bucket counted in bytes, shared by every connection of one process:
    it models the host's NIC (e.g. a 1 Gbps WAN link), so fanning out to N receivers divides
    the rate. ``bytes_per_s=None``: no limit."""

    def __init__(self, bytes_per_s: float | None, burst_bytes: int = 256 * 1024) -> None:
        super().__init__(bytes_per_s, burst_bytes)


def gbps(value: float | None) -> float | None:
    """Gigabits per second → bytes per second (None stays None: no limit)."""
    return None if value is None else value * 1e9 / 8
