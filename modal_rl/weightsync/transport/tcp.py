"""TCP transport: a frame server on the publisher, blocking clients on the receivers.

Wire protocol: the receiver connects and says which version it holds; with the run's key
both sides first prove they hold it (a challenge-response with fresh nonces from both
sides, ``auth``; the receiver checks the server's proof before it reads a frame byte, the
server checks the receiver's before it sends one). The server then sends the retained
frames the receiver lacks (deltas after its version, or the last anchor and the deltas
after it), then streams every frame published from then on. Records are self-delimiting
(``frames``), so the stream needs no other framing. A keyed server signs every record it
publishes (the receiver's ``VersionChain`` checks the MACs); a relay forwards them as they
are. ``key=None`` on both sides is the explicit keyless mode: no handshake, no MACs.

``TcpSource(tls=True)`` dials a TLS endpoint (a Modal tunnel's ``tls_socket``) and checks its certificate.

Invariants of ``FrameServer``:
- a receiver is admitted (added to the fan-out, sent retained frames) only after the
  handshake succeeded; a refused one gets one ``{"error": ...}`` line, is disconnected, and
  is logged on one line; every line it sends is bounded (``wire_json``);
- admission: a connection holds an unauthenticated slot only until its handshake ends, at
  most ``HANDSHAKE_TIMEOUT_S``; at most ``MAX_UNAUTHENTICATED`` such slots in all and
  ``MAX_UNAUTHENTICATED_PER_PEER`` per peer address, its own peer's stalled ones evicted
  first (``modal_rl.admission``), so hundreds of silent or half-sent sockets, even from the
  keyed receiver's own address, neither exhaust descriptors nor keep it out;
- a receiver only ever gets whole frames, starting at a frame boundary;
- each receiver has its own buffer of at most ``max_buffer_bytes``; a receiver whose buffer
  stays full for ``slow_timeout_s`` is disconnected (it reconnects and catches up), so a
  slow receiver stalls the publisher — and through it the others — at most that long;
- all connections share one ``ratelimit.TokenBucket`` counted in bytes: the rate limit models
  the host's NIC (e.g. a 1 Gbps WAN link), so fanning out to N receivers divides the rate.

Epochs (``epoch``): a publishing server holds its publisher's epoch (``open_epoch``). A
receiver's hello names the epoch it holds; a receiver that holds a *newer* epoch of the run
than the server's is refused — the server belongs to a trainer that a newer one replaced —
and so is one naming an epoch that starts beyond this clock (``from_the_future``). A hello
never changes the server's state: it is a peer's unsigned claim (any holder of the read key
can make it), so it cannot stop a trainer; a replaced trainer's frames are refused by every
receiver that moved on, and a store's signed lease is what stops it. Receivers of an older
epoch (or none) get the newest anchor.

Recovery anchors (``send_recovery``) are retained, never broadcast: a receiver that catches
up gets the newest anchor — wire or recovery — and the deltas after it, or the deltas after
its own version when it holds the server's epoch and those weigh less.

A relay (``FrameServer.forward``) re-serves records as they arrive from upstream, so
receivers can form a tree instead of all drawing on the trainer's link.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from modal_rl.admission import Admission
from modal_rl.ratelimit import TokenBucket
from modal_rl.text_safety import clean
from modal_rl.weightsync.codec.decode_costs import DecodeCosts, from_hello, slowest
from modal_rl.weightsync.transport import hello as lines
from modal_rl.weightsync.transport.base import FrameSink
from modal_rl.weightsync.transport.retention import Kept, kept_since, trim
from modal_rl.weightsync.transport.tcp_source import TcpSource  # the receiver side, re-exported
from modal_rl.weightsync.wire.auth import (
    FROM_ENV,
    HANDSHAKE,
    client_proof,
    frame_keys,
    new_nonce,
    same_proof,
    server_proof,
    sign_records,
)
from modal_rl.weightsync.wire.epoch import describe, from_the_future
from modal_rl.weightsync.wire.frames import TAG_END, TAG_VERSION, VersionHeader, record_body

log = logging.getLogger(__name__)
SLICE = 64 * 1024
LINK_BURST_BYTES = 256 * 1024  # what the link limiter lets through at once
# Admission bounds (the module docstring's invariants say why): two short lines and one round
# trip take well under a second even across the internet.
HANDSHAKE_TIMEOUT_S = 3.0
MAX_UNAUTHENTICATED = 64
MAX_UNAUTHENTICATED_PER_PEER = 8


@dataclass
class _Conn:
    writer: asyncio.StreamWriter
    have: int | None
    peer: str
    epoch: int | None = None
    costs: DecodeCosts | None = None  # what it named in its hello (``decode_costs``)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    buffered: int = 0
    space: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    closed: bool = False


class FrameServer(FrameSink):
    recovery_anchors = True  # retained for receivers that catch up (``send_recovery``)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        key=FROM_ENV,
        rate_bytes_per_s: float | None = None,
        max_buffer_bytes: int = 64 << 20,
        slow_timeout_s: float = 5.0,
        keep_anchors: int = 1,
    ) -> None:
        """``key``: the run key (default: ``MODAL_RL_RUN_KEY``; raises if unset), or ``None``
        for an explicitly keyless server (loopback tests)."""
        self.keys = frame_keys(key)
        self.limiter = TokenBucket(rate_bytes_per_s, burst=LINK_BURST_BYTES)
        self.max_buffer = max_buffer_bytes
        self.slow_timeout = slow_timeout_s
        # 0: retain nothing (late receivers catch up from a store's recovery anchors), so
        # the publisher holds no compressed copy of the model beside its snapshot
        self.keep_anchors = max(0, keep_anchors)
        self.retained: list[Kept] = []
        self.run: str | None = None
        self.epoch: int | None = None  # the publisher's epoch (None: a relay, or no publisher yet)
        self.active: list[_Conn] = []
        self.pending: list[_Conn] = []
        self.dropped = 0
        self.unauthenticated = Admission(
            MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_PEER, "weight-sync receiver"
        )
        self.handshake_timeout_s = HANDSHAKE_TIMEOUT_S
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
            self.server = self.loop.run_until_complete(
                asyncio.start_server(self._accept, host, port, limit=lines.MAX_LINE)
            )
            self.address = self.server.sockets[0].getsockname()[:2]
        except OSError as exc:
            self.address = exc
            ready.set()
            return
        ready.set()
        self.loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername"))
        slot = self.unauthenticated.hold(writer, reader)
        try:
            have, epoch, costs = await asyncio.wait_for(
                self._handshake(reader, writer), self.handshake_timeout_s
            )
        except lines.Refused as exc:
            log.warning("weight-sync receiver %s refused: %s", peer, clean(exc))
            try:
                writer.write(json.dumps({"error": str(exc)}).encode() + b"\n")
                await asyncio.wait_for(writer.drain(), 1.0)
            except (TimeoutError, ConnectionError, OSError):
                pass
            writer.close()
            return
        except (TimeoutError, ValueError, ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            if not slot.evicted:
                log.info("weight-sync receiver %s left during the handshake (%s)", peer, type(exc).__name__)
            writer.close()
            return
        finally:
            self.unauthenticated.release(slot)
        conn = _Conn(writer, have, peer, epoch, costs)
        conn.task = asyncio.ensure_future(self._write_loop(conn))
        if self.in_frame:
            self.pending.append(conn)  # joins at the next frame boundary
        else:
            self._admit(conn)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int | None, int | None, DecodeCosts | None]:
        """The receiver's (version, epoch, decode costs) once it is admitted; ``lines.Refused``
        otherwise. Nothing of a frame is written before this returns."""
        line = await lines.read_line(reader)
        hello = lines.parse(line, "hello")
        have, epoch = (lines.counter(hello, k) for k in ("have", "epoch"))
        costs = from_hello(hello.get("decode"))
        if self.keys is None:
            if "auth" in hello:
                raise lines.Refused(
                    "this frame server is keyless (key=None); a receiver with a key refuses it"
                )
            self._check_epoch(epoch)
            return have, epoch, costs
        nonce = hello.get("nonce")
        if hello.get("auth") != HANDSHAKE or not isinstance(nonce, str) or len(nonce) != 64:
            raise lines.Refused(
                "this frame server requires the run's key; the receiver offered none (keyless?)"
            )
        mine = new_nonce()
        answer = {"auth": HANDSHAKE, "nonce": mine, "proof": server_proof(self.keys, nonce, mine)}
        writer.write(json.dumps(answer).encode() + b"\n")
        self.unauthenticated.progressed(writer)  # its proof is one round trip away
        await writer.drain()
        reply = lines.parse(await lines.read_line(reader), "proof line")
        got = reply.get("proof")
        if not same_proof(client_proof(self.keys, nonce, mine, line), got):
            raise lines.Refused("the receiver does not know this run's key")
        self._check_epoch(epoch)  # the epoch is in the hello the proof covers
        return have, epoch, costs

    def _check_epoch(self, epoch: int | None) -> None:
        """Refuse a receiver that holds a newer epoch than this publisher's (this server's
        trainer was replaced) or claims one that has not started; the server is unchanged."""
        if epoch is not None and from_the_future(epoch):
            raise lines.Refused(
                f"the hello claims epoch {describe(epoch)}, which starts beyond this server's clock"
            )
        if self.epoch is None or epoch is None or epoch <= self.epoch:
            return
        raise lines.Refused(
            f"this frame server publishes epoch {describe(self.epoch)}, older than the receiver's "
            f"{describe(epoch)}: its trainer was replaced by a newer one"
        )

    def _admit(self, conn: _Conn) -> None:
        for kept in kept_since(self.retained, conn.have, conn.epoch):
            for rec in kept.records:
                self._enqueue(conn, rec)
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

    async def _end(self, header: VersionHeader, records: list[bytes]) -> None:
        self._retain(Kept(header, records))
        await self._frame_closed()

    def _retain(self, kept: Kept) -> None:
        self.retained.append(kept)
        trim(self.retained, self.keep_anchors)

    async def _frame_closed(self) -> None:
        """A frame boundary: receivers that connected mid-frame join now."""
        self.in_frame = False
        pending, self.pending = self.pending, []
        for conn in pending:
            self._admit(conn)

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # -- public -----------------------------------------------------------------------
    def frames_since(self, have: int | None, epoch: int | None = None) -> list[bytes]:
        """What a receiver at ``(epoch, have)`` lacks, of the newest retained epoch
        (``retention.kept_since``): the frames after ``have`` when it holds that epoch and they
        weigh less than the newest anchor's path, else that anchor and the deltas after it (a
        receiver that names no epoch gets the anchor: its version alone is no base)."""
        return [b"".join(k.records) for k in kept_since(self.retained, have, epoch)]

    def open_epoch(self, run: str, epoch: int) -> int:
        """A publisher starts on this server: it publishes ``epoch`` of ``run`` from now on."""
        self.run, self.epoch = run, epoch
        return epoch

    def _check_lease(self, header: VersionHeader) -> None:
        if self.epoch is not None and header.epoch != self.epoch:
            raise ValueError(f"frame of epoch {header.epoch:x} on a server of epoch {self.epoch:x}")

    def send_recovery(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """Retain a recovery anchor for receivers that catch up (not broadcast)."""
        self._check_lease(header)
        kept = Kept(header, list(sign_records(records, self.keys)), recovery=True)
        self._call(self._keep_recovery(kept))
        return kept.size

    async def _keep_recovery(self, kept: Kept) -> None:
        self._retain(kept)

    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """FrameSink: broadcast records as they are produced (signed with the server's key);
        retain the frame for catch-up."""
        self._check_lease(header)
        parts: list[bytes] = []  # what is retained (nothing with keep_anchors=0)
        sent = 0
        self._call(self._begin())
        try:
            for rec in sign_records(records, self.keys):
                sent += len(rec)
                if self.keep_anchors:
                    parts.append(rec)
                self._call(self._broadcast(rec))
        except BaseException:
            # An aborted frame: receivers got a prefix they will refuse; do not retain it.
            self._call(self._frame_closed())
            raise
        self._call(self._end(header, parts))
        return sent

    def forward(self, tag: bytes, raw: bytes) -> None:
        """Relay: re-serve one record received from upstream (call in arrival order). Records
        go on exactly as received (signed ones keep their MACs: downstream receivers verify
        them with the same run key); this server's key only admits the receivers."""
        tag = tag.upper()
        if tag == TAG_VERSION:
            self._frame_parts = []
            self._frame_header = VersionHeader.from_body(record_body(raw))
            self._call(self._begin())
        self._frame_parts.append(raw)
        self._call(self._broadcast(raw))
        if tag == TAG_END:
            self._call(self._end(self._frame_header, self._frame_parts))

    @property
    def receivers(self) -> int:
        return len(self.active)

    @property
    def link_share_bytes_per_s(self) -> float | None:
        """Bytes per second each connected receiver gets from the rate limit (the link is
        shared); None without a limit. The publisher codes for it (``CodecConfig``)."""
        rate = self.limiter.rate
        return None if rate is None else rate / max(1, len(self.active))

    @property
    def receiver_costs(self) -> DecodeCosts:
        """The decode costs to code for: the slowest connected receiver's (``decode_costs``)."""
        return slowest([conn.costs for conn in self.active])

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


__all__ = ["FrameServer", "TcpSource"]
