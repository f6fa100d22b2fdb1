"""An in-process transport written only against the declared ports (``FrameSink`` and
``FrameSource`` in ``modal_rl.weightsync.transport.base``): how a newcomer adds one.

It has every optional capability — a lease (an epoch newer than the holder's takes it, the
holder's next send raises ``LeaseLostError``), recovery anchors (retained for catch-up, never
streamed live) and streaming receive (records handed on as the sink appends them) — and no
more code in the publisher or the subscriber: they see only the ports.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator

from modal_rl.weightsync.errors import FrameInterruptedError, LeaseLostError
from modal_rl.weightsync.transport.base import Floor, FrameSink, FrameSource
from modal_rl.weightsync.transport.retention import Kept, kept_since
from modal_rl.weightsync.wire.auth import FROM_ENV, frame_keys, sign_records
from modal_rl.weightsync.wire.frames import RECORD_HEADER, TAG_END, VersionHeader


class Hub:
    """The shared medium: frames as their signed records, the lease's epoch, an event log."""

    def __init__(self, key=FROM_ENV) -> None:
        self.keys = frame_keys(key)
        self.cond = threading.Condition()
        self.frames: list[tuple[Kept, bool]] = []  # (frame, done); the last one may be growing
        self.epoch: int | None = None
        self.events: list[tuple[str, int]] = []  # ("sent" | "read", record index in its frame)
        self.hold_after: int | None = None  # the sink waits after this many records for a read


class MemorySink(FrameSink):
    recovery_anchors = True

    def __init__(self, hub: Hub) -> None:
        self.hub, self.keys, self.epoch = hub, hub.keys, None

    def open_epoch(self, run: str, epoch: int) -> int:
        with self.hub.cond:
            self.hub.epoch = self.epoch = epoch  # the newest trainer takes the lease
        return epoch

    def _append(self, header: VersionHeader, records: Iterable[bytes], recovery: bool) -> int:
        hub = self.hub
        with hub.cond:
            if hub.epoch != self.epoch:
                raise LeaseLostError(f"epoch {hub.epoch:x} took the lease from {self.epoch:x}")
            kept = Kept(header, [], recovery)
            hub.frames.append((kept, False))
        for i, rec in enumerate(sign_records(records, self.keys)):
            with hub.cond:
                kept.records.append(rec)
                hub.events.append(("sent", i))
                hub.cond.notify_all()
                if not recovery and hub.hold_after == i + 1:
                    hub.cond.wait_for(lambda: ("read", 0) in hub.events, timeout=10)
        with hub.cond:
            hub.frames[-1] = (kept, True)
            hub.cond.notify_all()
        return kept.size

    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        return self._append(header, records, recovery=False)

    def send_recovery(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        return self._append(header, records, recovery=True)

    def close(self) -> None:
        pass


class MemorySource(FrameSource):
    streams = True

    def __init__(self, hub: Hub) -> None:
        self.hub, self.keys = hub, hub.keys

    def _next(self, have: int | None, epoch: int | None) -> Kept | None:
        """The next frame for a receiver at ``(epoch, have)``: the first of what it lacks among
        the finished frames, else a live frame that starts where it stands."""
        done = [k for k, finished in self.hub.frames if finished]
        lacking = kept_since(done, have, epoch)
        if lacking:
            return lacking[0]
        growing = [k for k, finished in self.hub.frames if not finished and not k.recovery]
        if growing and (growing[0].header.kind == "anchor" or growing[0].header.base_version == have):
            return growing[0]
        return None

    def next_records(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: Floor | None = None,
    ) -> Iterator[tuple[bytes, bytes]] | None:
        kept = self._wait(have_version, timeout, epoch)
        return None if kept is None else self._records(kept)

    def _wait(self, have: int | None, timeout: float | None, epoch: int | None) -> Kept | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.hub.cond:
            while (kept := self._next(have, epoch)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.hub.cond.wait(left)
        return kept

    def _records(self, kept: Kept) -> Iterator[tuple[bytes, bytes]]:
        started, size = time.monotonic(), 0
        for i in itertools.count():
            with self.hub.cond:
                if not self.hub.cond.wait_for(lambda i=i: i < len(kept.records), timeout=10):
                    raise FrameInterruptedError("the memory sink stopped in the middle of a frame")
                raw = kept.records[i]
                self.hub.events.append(("read", i))
                self.hub.cond.notify_all()
            tag = RECORD_HEADER.unpack_from(raw)[0]
            size += len(raw)
            if tag.upper() == TAG_END:
                self.last_fetch_s, self.last_frame_bytes = time.monotonic() - started, size
            yield tag, raw
            if tag.upper() == TAG_END:
                return

    def next_frame(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: Floor | None = None,
    ) -> bytes | None:
        """A whole frame, once the sink finished it (what a source that cannot stream does)."""
        kept = self._wait(have_version, timeout, epoch)
        if kept is None:
            return None
        with self.hub.cond:
            if not self.hub.cond.wait_for(
                lambda: any(k is kept and done for k, done in self.hub.frames), timeout=10
            ):
                raise FrameInterruptedError("the memory sink stopped in the middle of a frame")
        return b"".join(kept.records)

    def close(self) -> None:
        pass
