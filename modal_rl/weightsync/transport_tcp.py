"""TCP transport: a frame server on the publisher, blocking clients on the receivers.

Wire protocol: the receiver connects and sends one JSON line ``{"have": <version|null>}``;
the server answers with the retained frames the receiver lacks (deltas after its version,
or the last anchor and the deltas after it), then streams every frame published from then
on. Records are self-delimiting (``frames``), so the stream needs no other framing.

Invariants of ``FrameServer``:
- a receiver only ever gets whole frames, starting at a frame boundary;
- each receiver has its own buffer of at most ``max_buffer_bytes``; a receiver whose buffer
  stays full for ``slow_timeout_s`` is disconnected (it reconnects and catches up), so a
  slow receiver stalls the publisher — and through it the others — at most that long;
- all connections share one ``TokenBucket``: the rate limit models the host's NIC.

A relay (``FrameServer.forward``) re-serves records as they arrive from upstream, so
receivers can form a tree instead of all drawing on the trainer's link.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from modal_rl.weightsync.frames import (
    RECORD_HEADER,
    RECORD_TRAILER,
    TAG_END,
    TAG_VERSION,
    VersionHeader,
)
from modal_rl.weightsync.transport import TokenBucket

log = logging.getLogger(__name__)
SLICE = 64 * 1024


@dataclass
class _Conn:
    writer: asyncio.StreamWriter
    have: int | None
    peer: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    buffered: int = 0
    space: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    closed: bool = False


class FrameServer:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        rate_bytes_per_s: float | None = None,
        max_buffer_bytes: int = 64 << 20,
        slow_timeout_s: float = 5.0,
        keep_anchors: int = 1,
    ) -> None:
        self.limiter = TokenBucket(rate_bytes_per_s)
        self.max_buffer = max_buffer_bytes
        self.slow_timeout = slow_timeout_s
        self.keep_anchors = keep_anchors
        self.retained: list[tuple[VersionHeader, bytes]] = []
        self.active: list[_Conn] = []
        self.pending: list[_Conn] = []
        self.dropped = 0
        self.in_frame = False
        self._frame_parts: list[bytes] = []
        self._frame_header: VersionHeader | None = None
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run_loop, args=(host, port, ready), daemon=True)
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("frame server did not start")
        if isinstance(self.address, Exception):
            raise self.address

    # -- loop thread -------------------------------------------------------------------
    def _run_loop(self, host: str, port: int, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.server = self.loop.run_until_complete(asyncio.start_server(self._accept, host, port))
            self.address = self.server.sockets[0].getsockname()[:2]
        except OSError as exc:
            self.address = exc
            ready.set()
            return
        ready.set()
        self.loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername"))
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), 10))
            have = hello.get("have")
        except (TimeoutError, ValueError, AttributeError):
            writer.close()
            return
        conn = _Conn(writer, have if isinstance(have, int) else None, peer)
        conn.task = asyncio.ensure_future(self._write_loop(conn))
        if self.in_frame:
            self.pending.append(conn)  # joins at the next frame boundary
        else:
            self._admit(conn)

    def _admit(self, conn: _Conn) -> None:
        for frame in self.frames_since(conn.have):
            self._enqueue(conn, frame)
        self.active.append(conn)

    def _enqueue(self, conn: _Conn, data: bytes) -> None:
        conn.buffered += len(data)
        conn.queue.put_nowait(data)

    async def _write_loop(self, conn: _Conn) -> None:
        try:
            while True:
                data = await conn.queue.get()
                for start in range(0, len(data), SLICE):
                    piece = data[start : start + SLICE]
                    await self.limiter.acquire(len(piece))
                    conn.writer.write(piece)
                    await conn.writer.drain()
                conn.buffered -= len(data)
                conn.space.set()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            self._drop(conn, "connection closed")

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        for group in (self.active, self.pending):
            if conn in group:
                group.remove(conn)
        conn.writer.close()
        if conn.task is not None and conn.task is not asyncio.current_task():
            conn.task.cancel()
        log.info("weight-sync receiver %s dropped: %s", conn.peer, why)

    async def _broadcast(self, data: bytes) -> None:
        for conn in list(self.active):
            deadline = time.monotonic() + self.slow_timeout
            while conn.buffered + len(data) > self.max_buffer and conn.buffered > 0 and not conn.closed:
                conn.space.clear()
                remaining = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(conn.space.wait(), max(remaining, 0.001))
                except TimeoutError:
                    self.dropped += 1
                    self._drop(conn, f"slower than the back-pressure bound ({self.slow_timeout}s)")
                    break
            if not conn.closed:
                self._enqueue(conn, data)

    async def _begin(self) -> None:
        self.in_frame = True

    async def _end(self, header: VersionHeader, frame: bytes) -> None:
        self.retained.append((header, frame))
        anchors = [i for i, (h, _) in enumerate(self.retained) if h.kind == "anchor"]
        if len(anchors) > self.keep_anchors:
            del self.retained[: anchors[-self.keep_anchors]]
        await self._frame_closed()

    async def _frame_closed(self) -> None:
        """A frame boundary: receivers that connected mid-frame join now."""
        self.in_frame = False
        pending, self.pending = self.pending, []
        for conn in pending:
            self._admit(conn)

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # -- public -----------------------------------------------------------------------
    def frames_since(self, have: int | None) -> list[bytes]:
        versions = [h.version for h, _ in self.retained]
        if have is not None and have in versions:
            return [frame for _, frame in self.retained[versions.index(have) + 1 :]]
        if have is not None and versions and have > versions[-1]:
            return []
        anchors = [i for i, (h, _) in enumerate(self.retained) if h.kind == "anchor"]
        return [frame for _, frame in self.retained[anchors[-1] :]] if anchors else []

    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """FrameSink: broadcast records as they are produced; retain the frame for catch-up."""
        parts: list[bytes] = []
        self._call(self._begin())
        try:
            for rec in records:
                parts.append(rec)
                self._call(self._broadcast(rec))
        except BaseException:
            # An aborted frame: receivers got a prefix they will refuse; do not retain it.
            self._call(self._frame_closed())
            raise
        frame = b"".join(parts)
        self._call(self._end(header, frame))
        return len(frame)

    def forward(self, tag: bytes, raw: bytes) -> None:
        """Relay: re-serve one record received from upstream (call in arrival order)."""
        if tag == TAG_VERSION:
            self._frame_parts = []
            self._frame_header = VersionHeader.from_body(raw[RECORD_HEADER.size : -RECORD_TRAILER.size])
            self._call(self._begin())
        self._frame_parts.append(raw)
        self._call(self._broadcast(raw))
        if tag == TAG_END:
            self._call(self._end(self._frame_header, b"".join(self._frame_parts)))

    @property
    def receivers(self) -> int:
        return len(self.active)

    def close(self) -> None:
        async def shutdown() -> None:
            for conn in list(self.active) + list(self.pending):
                self._drop(conn, "server closing")
            self.server.close()
            await self.server.wait_closed()

        if self.loop.is_running():
            self._call(shutdown())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        self.loop.close()


class TcpSource:
    """Receiver side: a blocking client that reconnects (with its version) on any failure.

    ``on_record(tag, raw)`` sees every record as it arrives — a relay forwards with it.
    ``last_fetch_s`` is the time from a frame's first record to its last.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 10.0,
        backoff_s: float = 0.1,
        on_record=None,
    ) -> None:
        self.addr = (host, port)
        self.connect_timeout = connect_timeout_s
        self.backoff = backoff_s
        self.on_record = on_record
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        self.parts: list[bytes] = []
        self.frame_started = 0.0
        self.last_fetch_s = 0.0
        self.reconnects = 0

    def _connect(self, have: int | None, deadline: float | None) -> bool:
        while True:
            try:
                sock = socket.create_connection(self.addr, timeout=self.connect_timeout)
                sock.sendall(json.dumps({"have": have}).encode() + b"\n")
                self.sock, self.buf, self.parts = sock, bytearray(), []
                return True
            except OSError:
                if deadline is not None and time.monotonic() + self.backoff > deadline:
                    return False
                time.sleep(self.backoff)

    def reset(self) -> None:
        """Drop the connection; the next call reconnects and asks for what it lacks."""
        if self.sock is not None:
            self.sock.close()
            self.reconnects += 1
        self.sock = None

    def _take_record(self) -> tuple[bytes, bytes] | None:
        if len(self.buf) < RECORD_HEADER.size:
            return None
        tag, length = RECORD_HEADER.unpack_from(self.buf)
        total = RECORD_HEADER.size + length + RECORD_TRAILER.size
        if len(self.buf) < total:
            return None
        raw = bytes(self.buf[:total])
        del self.buf[:total]
        return tag, raw

    def next_frame(self, have_version: int | None, timeout: float | None = None) -> bytes | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.sock is None and not self._connect(have_version, deadline):
                return None
            taken = self._take_record()
            if taken is not None:
                tag, raw = taken
                if self.on_record is not None:
                    self.on_record(tag, raw)
                if tag == TAG_VERSION:
                    self.parts, self.frame_started = [], time.monotonic()
                self.parts.append(raw)
                if tag == TAG_END:
                    frame, self.parts = b"".join(self.parts), []
                    self.last_fetch_s = time.monotonic() - self.frame_started
                    return frame
                continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                return None
            except OSError:
                data = b""
            if not data:  # publisher gone or dropped us: reconnect and resume
                self.reset()
                time.sleep(self.backoff)
                continue
            self.buf += data

    def close(self) -> None:
        self.reset()
