"""Transport port: how frames move from one publisher to many subscribers.

Two implementations, one file each: ``transport.tcp`` (a frame server on the trainer,
streaming to receivers over plain TCP with fan-out, back-pressure, a rate limit and
resume) and ``transport.store`` (publish/subscribe through a directory, or a Modal Volume
with commit/reload). Both carry frames exactly as ``codec`` writes them; neither trusts
them — the subscriber's ``VersionChain`` verifies every frame.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Iterator
from typing import Any

from modal_rl.weightsync.wire.auth import FROM_ENV
from modal_rl.weightsync.wire.frames import VersionHeader

Floor = tuple[int | None, int]  # (epoch or None, version): a receiver's floor


class FrameSink(abc.ABC):
    """Publisher side of a transport: everything ``Publisher`` uses, stated here.

    Required: ``send`` and ``close``. Optional capabilities have the defaults of a transport
    that has no such thing (the publisher relies on them, never on probing):
    - ``keys``: the run's frame keys the sink signs with (its run id names the frames);
      ``None``: keyless;
    - ``open_epoch``: a sink with a lease (a store) takes it here, so a second trainer fails
      at start; default: no lease, the epoch as given;
    - ``recovery_anchors``/``send_recovery``: a sink that keeps recovery anchors for receivers
      that catch up (default: none; the publisher then never encodes one);
    - ``link_share_bytes_per_s`` / ``receiver_costs``: what a rate-limited sink knows of each
      receiver's share of its link and of their decode costs (default: nothing; deltas are
      then coded for size)."""

    keys: Any = None
    recovery_anchors: bool = False
    link_share_bytes_per_s: float | None = None
    receiver_costs: Any = None

    @abc.abstractmethod
    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """Deliver one frame's records, in order, as they are produced (so encoding and
        sending overlap). Returns the frame's size in bytes. When it returns, the frame is
        durable (store) or queued to every connected receiver (tcp)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def open_epoch(self, run: str, epoch: int) -> int:
        """A publisher of ``run`` starts: the epoch it publishes from now on."""
        return epoch

    def send_recovery(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """Keep a recovery anchor (only called when ``recovery_anchors``); its size."""
        raise NotImplementedError(f"{type(self).__name__} keeps no recovery anchors")


class FrameSource(abc.ABC):
    """Subscriber side of a transport: everything ``Subscriber`` uses, stated here.

    Required: ``next_frame`` and ``close``. Optional capabilities, with their defaults:
    - ``keys``: the frame keys frames must be signed with (default: the run key from the
      environment, ``FROM_ENV``; ``None``: explicitly keyless);
    - ``streams``/``next_records``: a source that hands a frame's records on as they arrive,
      so decoding overlaps the transfer (default: whole frames);
    - ``reset``: called after a refused frame, to reconnect and ask again (default: nothing);
    - ``last_fetch_s``/``last_frame_bytes``: the last frame's transfer time and size, when the
      source measures them (streaming sources must set ``last_frame_bytes``).

    ``epoch`` and ``floor`` are the receiver's: a source may use them to pick what to send and
    to refuse a rolled-back store before reading it; the chain checks both again."""

    keys: Any = FROM_ENV
    streams: bool = False
    last_fetch_s: float | None = None
    last_frame_bytes: int = 0

    @abc.abstractmethod
    def next_frame(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: Floor | None = None,
    ) -> bytes | None:
        """The next frame a receiver at ``(epoch, have_version)`` needs (an anchor if it has
        nothing or fell behind the retained deltas), or None if none arrived within ``timeout``."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def next_records(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: Floor | None = None,
    ) -> Iterator[tuple[bytes, bytes]] | None:
        """The next frame as ``(tag, raw record)`` pairs as they arrive (only when ``streams``)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream records")

    def reset(self) -> None:  # noqa: B027 (an optional hook: a no-op where nothing reconnects)
        """Drop any connection; the next call asks again for what the receiver lacks."""


def joined_frame(
    source: FrameSource,
    have_version: int | None,
    timeout: float | None,
    epoch: int | None,
    floor: Floor | None,
) -> bytes | None:
    """``next_frame`` of a streaming source: the next frame's records joined once its end
    arrived; a frame cut off on the way is asked for again within what is left of
    ``timeout``. None when no frame began in time."""
    from modal_rl.weightsync.errors import FrameInterruptedError

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        records = source.next_records(have_version, left, epoch, floor)
        if records is None:
            return None
        try:
            return b"".join(raw for _, raw in records)
        except FrameInterruptedError:
            continue


def gbps(value: float | None) -> float | None:
    """Gigabits per second → bytes per second (None stays None: no limit)."""
    return None if value is None else value * 1e9 / 8
