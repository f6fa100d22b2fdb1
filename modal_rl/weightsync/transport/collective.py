"""Collective transport: frames broadcast over a ``torch.distributed`` process group.

For a trainer and its engines inside one cluster (a Modal RDMA cluster: NCCL over the
GPUs' fabric; gloo over TCP on CPUs, as here), beside the TCP frame server: the same
signed frames, one broadcast per record, from the publishing rank ``src`` to every other
member of ``group``.

Wire: per block, two broadcasts from ``src``: an int64 pair ``(kind, length)``, then
``length`` bytes. A ``RECORDS`` block is whole records back to back, exactly as
``sign_records`` made them (tag, length, body, MAC): up to ``block_bytes`` (4 MiB) of them,
sent early at a frame's version header (so receivers choose at once) and at its end record.
Blocks, not records, because each broadcast is a rendezvous of every member: a delta's
chunk records are tens of KB, and one rendezvous each measured 2.4x TCP's time per version
on a busy 2-core host. ``ABORT``: the publisher gave the frame up, receivers drop what they
have of it; ``CLOSE``: the sink is closed, receivers stop taking part.

Invariants:
- every member takes part in every broadcast, in order (a collective's rule): each
  ``CollectiveSource`` runs one thread that does nothing else, so a receiver that is
  decoding, activating or refusing never stalls the group for longer than its bounded
  queues (``max_frames`` frames, ``max_records`` records each) take to fill; then the
  publisher waits for it: the group goes at its slowest member's pace (back-pressure, as a
  TCP server's send window);
- the group is the weight sync's own (``torch.distributed.new_group``): no other collective
  may run on it, or the orders would interleave;
- records are passed on unverified (the ``Subscriber``'s chain checks their MACs with
  ``keys``); the host reads only a record's length (bounded by ``MAX_RECORD_BYTES``) and, of
  a frame's first record, the version header (JSON, bounded), to skip frames this receiver
  cannot use: a delta for another base, an anchor not newer than what it holds. A collective
  cannot be asked again, so a receiver that refused a frame takes the next anchor
  (``Publisher(anchor_every=K)`` bounds the wait); one that joins late, or is replaced, has
  no place in a formed group and catches up over TCP or a store instead;
- ``ABORT`` or a stall of ``FRAME_STALL_S`` inside a frame raises ``FrameInterruptedError``
  (the chain rolls the frame back).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from modal_rl.weightsync.catchup import CannotCatchUp, Held, Retained, catch_up
from modal_rl.weightsync.errors import FrameInterruptedError, WeightSyncError
from modal_rl.weightsync.transport.base import Floor, FrameSink, FrameSource, joined_frame
from modal_rl.weightsync.wire.auth import FROM_ENV, frame_keys, sign_records, trailer_size
from modal_rl.weightsync.wire.frames import (
    MAX_RECORD_BYTES,
    RECORD_HEADER,
    TAG_END,
    TAG_VERSION,
    VersionHeader,
    record_body,
    record_tag,
)

RECORDS, ABORT, CLOSE = 1, 2, 3
BLOCK_BYTES = 4 << 20
FRAME_STALL_S = 60.0
MAX_HEADER_BYTES = 1 << 16  # a version header record is a few hundred bytes of JSON


def _device_for(group: Any, device: str | None) -> Any:
    """Where broadcast tensors live: given, else the CPU for gloo and the current GPU for NCCL."""
    import torch
    import torch.distributed as dist

    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CollectiveSink(FrameSink):
    """Publisher side: broadcasts each signed record from ``src`` (a global rank; this
    process) to ``group``. ``key``: the run key (default: from the environment), or None for
    keyless frames."""

    def __init__(
        self,
        group: Any = None,
        src: int = 0,
        *,
        key=FROM_ENV,
        device: str | None = None,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        import torch.distributed as dist

        if dist.get_rank() != src:
            raise ValueError(
                f"CollectiveSink runs on the publishing rank {src}, not on rank {dist.get_rank()}"
            )
        self.group, self.src = group, src
        self.keys = frame_keys(key)
        self.device = _device_for(group, device)
        self.block_bytes = block_bytes
        self.closed = False

    def _broadcast(self, kind: int, payload: bytes = b"") -> None:
        import torch
        import torch.distributed as dist

        head = torch.tensor([kind, len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(head, self.src, group=self.group)
        if payload:
            body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            dist.broadcast(body, self.src, group=self.group)

    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """Broadcast the frame's records as they are produced; returns its size. A frame that
        fails part way is announced (``ABORT``) before the error goes on."""
        if self.closed:
            raise WeightSyncError("this collective sink is closed")
        sent, block, pending = 0, [], 0
        try:
            for rec in self._signed(records):
                block.append(rec)
                pending += len(rec)
                sent += len(rec)
                if pending >= self.block_bytes or record_tag(rec) in (TAG_VERSION, TAG_END):
                    self._broadcast(RECORDS, b"".join(block))
                    block, pending = [], 0
        except BaseException:
            self._broadcast(ABORT)
            raise
        return sent

    def _signed(self, records: Iterable[bytes]) -> Iterator[bytes]:
        return sign_records(records, self.keys)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._broadcast(CLOSE)


class _Frame:
    """One frame as it arrives: its header (unverified, for skipping) and a bounded queue of
    raw records; ``dropped`` once the receiver no longer wants the rest."""

    def __init__(self, header: VersionHeader | None, max_records: int) -> None:
        self.header = header
        self.records: queue.Queue = queue.Queue(max_records)
        self.dropped = threading.Event()

    def put(self, item: Any) -> None:
        while not self.dropped.is_set():
            try:
                self.records.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def drop(self) -> None:
        self.dropped.set()
        while True:  # free the slots the participant may be waiting for
            try:
                self.records.get_nowait()
            except queue.Empty:
                return


class CollectiveSource(FrameSource):
    """Receiver side: a member of ``group`` that takes every broadcast from ``src`` on a
    thread of its own and hands frames on record by record (``streams``)."""

    streams = True

    def __init__(
        self,
        group: Any = None,
        src: int = 0,
        *,
        key=FROM_ENV,
        device: str | None = None,
        max_frames: int = 2,
        max_records: int = 64,
    ) -> None:
        self.group, self.src = group, src
        self.keys = frame_keys(key)
        self.device = _device_for(group, device)
        self._frames: queue.Queue = queue.Queue(max_frames)
        self._max_records = max_records
        self.closed = threading.Event()  # the publisher closed its sink, or the group failed
        self.failure: Exception | None = None  # why the group failed, if it did
        self.skipped = 0  # frames this receiver could not use (see the module docstring)
        self._current: _Frame | None = None  # the frame handed on last
        self._thread = threading.Thread(target=self._take_part, name="weight-sync-collective", daemon=True)
        self._thread.start()

    # -- the participant thread: every broadcast, in order ----------------------------------
    def _receive(self) -> tuple[int, bytes]:
        import torch
        import torch.distributed as dist

        head = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(head, self.src, group=self.group)
        kind, length = (int(v) for v in head.tolist())
        if kind == RECORDS and not 0 < length <= MAX_RECORD_BYTES + BLOCK_BYTES:
            raise WeightSyncError(f"collective block of {length} bytes is out of bounds")
        if kind != RECORDS:
            return kind, b""
        body = torch.empty(length, dtype=torch.uint8, device=self.device)
        dist.broadcast(body, self.src, group=self.group)
        return kind, body.cpu().numpy().tobytes()

    def _take_part(self) -> None:
        frame: _Frame | None = None
        try:
            while True:
                kind, block = self._receive()
                if kind == CLOSE:
                    break
                records = _split(block) if kind == RECORDS else None
                if records is None:  # given up, or a block that does not parse: the frame ends
                    if frame is not None:
                        frame.put(ABORT)
                    frame = None
                    continue
                for raw in records:
                    if record_tag(raw) == TAG_VERSION:  # a frame begins (a cut one ends here)
                        if frame is not None:
                            frame.put(ABORT)
                        frame = _Frame(_peek_header(raw), self._max_records)
                        self._frames.put(frame)  # blocks while max_frames wait: back-pressure
                    if frame is not None:  # else: the tail of a frame begun before we joined
                        frame.put(raw)
        except Exception as exc:  # noqa: BLE001 - a broken group: said by the next fetch
            self.failure = exc
        finally:
            if frame is not None:
                frame.put(ABORT)
            self.closed.set()

    # -- the subscriber's side ------------------------------------------------------------
    def next_frame(self, have_version, timeout=None, epoch=None, floor=None) -> bytes | None:
        return joined_frame(self, have_version, timeout, epoch, floor)

    def next_records(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: Floor | None = None,
    ) -> Iterator[tuple[bytes, bytes]] | None:
        """The next frame this receiver can use, record by record, or None when none began
        within ``timeout``. Frames it cannot use are dropped (``skipped``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                frame = self._frames.get(timeout=min(left, 0.5) if left is not None else 0.5)
            except queue.Empty:
                if self.closed.is_set() and self._frames.empty():
                    if self.failure is not None:
                        raise WeightSyncError(
                            f"the weight sync's process group failed ({self.failure}); a collective "
                            "cannot recover a member: restart the group, or sync over TCP"
                        ) from self.failure
                    return None
                continue
            if self._current is not None:  # a frame left part way (refused): drop its rest
                self._current.drop()
            if _usable(frame.header, have_version, epoch):
                self._current = frame
                return self._rest_of_frame(frame)
            frame.drop()
            self.skipped += 1

    def _rest_of_frame(self, frame: _Frame) -> Iterator[tuple[bytes, bytes]]:
        started, size = time.monotonic(), 0
        try:
            while True:
                try:
                    item = frame.records.get(timeout=FRAME_STALL_S)
                except queue.Empty:
                    raise FrameInterruptedError(
                        "the collective went quiet in the middle of a frame"
                    ) from None
                if item is ABORT:
                    raise FrameInterruptedError("the publisher gave this frame up part way")
                size += len(item)
                tag = item[:1]
                if record_tag(item) == TAG_END:  # the end record: account for the frame first
                    self.last_fetch_s, self.last_frame_bytes = time.monotonic() - started, size
                yield tag, item
                if record_tag(item) == TAG_END:
                    return
        finally:
            frame.drop()  # whatever is left (a refused or cut frame) is not ours to keep

    def close(self) -> None:
        """Stop handing frames on; the thread ends with the publisher's ``CLOSE`` (a member
        cannot leave a formed group earlier without stalling it)."""


def _split(block: bytes) -> list[bytes] | None:
    """A block's whole records, each within the block by its declared length (None: one is
    not; the chain would refuse the frame anyway, so it is cut here)."""
    out, at = [], 0
    while at < len(block):
        if at + RECORD_HEADER.size > len(block):
            return None
        tag, length = RECORD_HEADER.unpack_from(block, at)
        end = at + RECORD_HEADER.size + length + trailer_size(tag)
        if end > len(block):
            return None
        out.append(block[at:end])
        at = end
    return out


def _peek_header(raw: bytes) -> VersionHeader | None:
    """The version header of a frame's first record, unverified (only to skip frames this
    receiver cannot use; the chain verifies what it applies); None if it does not parse."""
    if len(raw) > MAX_HEADER_BYTES:
        return None
    try:
        return VersionHeader.from_body(record_body(raw))
    except Exception:  # noqa: BLE001 - unparsable: handed on, and the chain refuses it
        return None


def _usable(header: VersionHeader | None, have: int | None, epoch: int | None) -> bool:
    """A frame worth decoding for a receiver at (``epoch``, ``have``): what a frame server
    would send it (``catchup.catch_up`` over this one frame). An unparsable header is handed on
    (the chain refuses it, and says why)."""
    if header is None:
        return True
    frame = Retained(
        header.kind, header.version, header.epoch, header.base_version, 0, False, header.base_digest
    )
    plan = catch_up(None if have is None else Held(have, epoch), [frame])
    return not isinstance(plan, CannotCatchUp) and plan == [0]
