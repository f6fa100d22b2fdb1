"""TCP transport, receiver side: ``TcpSource`` (the server side and the wire protocol are
described in ``transport.tcp``, which re-exports this class).

Invariants:
- with a key, no record byte is read before the server proved it holds the run key (the
  handshake); a server that fails it, refuses us, or presents a TLS certificate that does
  not verify raises ``HandshakeError`` (after a short backoff, so a retrying caller does not
  hammer it); connection failures are retried until the caller's deadline;
- the hello names the version held and its epoch; a server of an older epoch refuses the
  receiver (its trainer was replaced), which counts as a refusal like a failed handshake;
- ``last_error`` keeps why the last connection attempt failed (e.g. connection refused),
  so a caller whose deadline passed can say so;
- records are taken whole and passed on unverified (the ``Subscriber``'s chain verifies them
  with ``keys``); ``next_frame`` returns a frame only once its end record arrived, while
  ``next_records`` hands the frame's records on as they arrive (the chain decodes them
  meanwhile) and raises ``FrameInterruptedError`` if the frame is cut off before its end
  record: the connection lost, no byte for ``FRAME_STALL_S``, or a new frame begun (that
  frame's version header is kept and starts the next call, not seen twice by ``on_record``).
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass

from modal_rl.weightsync.codec.decode_costs import measured as measured_costs
from modal_rl.weightsync.errors import FrameInterruptedError, HandshakeError
from modal_rl.weightsync.transport.base import Floor, FrameSource, joined_frame
from modal_rl.weightsync.wire.auth import (
    FROM_ENV,
    check_server_hello,
    client_proof,
    frame_keys,
    hello_line,
    refusal,
    trailer_size,
)
from modal_rl.weightsync.wire.frames import RECORD_HEADER, TAG_END, TAG_VERSION

MAX_LINE = 4096
# A frame in flight with no byte for this long is given up (and asked for again): records
# of one frame follow each other as fast as the publisher encodes them.
FRAME_STALL_S = 60.0


@dataclass(frozen=True)
class Dial:
    """How a ``TcpSource`` dials: ``connect_timeout_s`` bounds a connect (and each read of the
    handshake), ``backoff_s`` is the pause before dialing again after a refused or failed try."""

    connect_timeout_s: float = 10.0
    backoff_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"Dial {name}={value!r}: give a number of seconds >= 0")
        if self.connect_timeout_s == 0:
            raise ValueError("Dial connect_timeout_s=0: give a number of seconds > 0")


class TcpSource(FrameSource):
    """Receiver side: a blocking client that reconnects (with its version) on any failure.

    ``key``: the run key (default: ``MODAL_RL_RUN_KEY``), or ``None`` for a keyless server.
    With a key, every connection starts with the mutual handshake, and the ``Subscriber``
    built on this source accepts only frames signed with that key (``keys``).
    ``tls=True`` speaks TLS to the endpoint (certificate checked against the system's CAs,
    or ``cafile``; host name ``server_hostname``, default ``host``).
    ``on_record(tag, raw)`` sees every record as it arrives — a relay forwards with it.
    ``last_fetch_s`` is the time from a frame's first record to its last. A ``floor`` is
    the chain's to enforce (the server sends what the receiver's version and epoch lack).
    """

    streams = True

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key=FROM_ENV,
        tls: bool = False,
        cafile: str | None = None,
        server_hostname: str | None = None,
        dial: Dial | None = None,
        on_record=None,
    ) -> None:
        dial = dial or Dial()
        self.keys = frame_keys(key)
        self.addr = (host, port)
        self.tls = tls
        self._ssl = ssl.create_default_context(cafile=cafile) if tls else None
        self.server_hostname = server_hostname or host
        self.connect_timeout = dial.connect_timeout_s
        self.backoff = dial.backoff_s
        self.on_record = on_record
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        self.last_fetch_s = 0.0
        self.last_frame_bytes = 0
        self._pending: tuple[bytes, bytes] | None = None  # a version header that cut a frame off
        self.reconnects = 0
        self.connected_once = False
        self.last_error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.addr[0]}:{self.addr[1]}{' (TLS)' if self.tls else ''}"

    def _connect(self, have: int | None, deadline: float | None, epoch: int | None = None) -> bool:
        """Connect and pass the handshake; False when the deadline passed first. A server
        that fails the handshake (or a TLS certificate check) raises ``HandshakeError``."""
        while True:
            sock = None
            try:
                sock = socket.create_connection(self.addr, timeout=self.connect_timeout)
                if self._ssl is not None:
                    sock = self._ssl.wrap_socket(sock, server_hostname=self.server_hostname)
                self.sock, self.buf, self._pending = sock, bytearray(), None
                self._handshake(have, epoch)
                self.connected_once, self.last_error = True, None
                return True
            except ssl.SSLCertVerificationError as exc:
                self._fail(sock, refused=True)
                raise HandshakeError(
                    f"TLS certificate of {self.where} failed verification: {exc.verify_message}"
                ) from None
            except HandshakeError:
                self._fail(sock, refused=True)
                raise
            except OSError as exc:
                self.last_error = _why(exc)
                self._fail(sock)
                if deadline is not None and time.monotonic() + self.backoff > deadline:
                    return False
                time.sleep(self.backoff)

    def _fail(self, sock: socket.socket | None, refused: bool = False) -> None:
        if sock is not None:
            sock.close()
        self.sock = None
        if refused:
            time.sleep(self.backoff)  # a receiver that retries does not hammer a refusing server

    def _handshake(self, have: int | None, epoch: int | None = None) -> None:
        costs = measured_costs()  # once this receiver's warm-up measured them
        line, nonce = hello_line(have, self.keys, epoch, costs.hello() if costs else None)
        self.sock.sendall(line)
        if self.keys is None:
            return  # keyless: records follow (or the server's refusal line)
        server_nonce = check_server_hello(self._read_line(), self.keys, nonce, self.where)
        proof = client_proof(self.keys, nonce, server_nonce, line)
        self.sock.sendall(json.dumps({"proof": proof}).encode() + b"\n")

    def _read_line(self) -> bytes:
        self.sock.settimeout(self.connect_timeout)
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise HandshakeError(f"{self.where} is not a weight-sync frame server (no handshake line)")
            data = self.sock.recv(MAX_LINE)
            if not data:
                raise ConnectionResetError("closed during the handshake")
            self.buf += data
        end = self.buf.index(b"\n") + 1
        line = bytes(self.buf[:end])
        del self.buf[:end]
        return line

    def reset(self) -> None:
        """Drop the connection; the next call reconnects and asks for what it lacks."""
        if self.sock is not None:
            self.sock.close()
            self.reconnects += 1
        self.sock = None

    def _take_record(self) -> tuple[bytes, bytes] | None:
        if self.buf[:1] == b"{":  # a keyless receiver refused by a keyed server: one JSON line
            if b"\n" not in self.buf:
                return None
            line = bytes(self.buf[: self.buf.index(b"\n") + 1])
            self.reset()
            time.sleep(self.backoff)  # a receiver that retries does not hammer a refusing server
            raise HandshakeError(refusal(line, self.where))
        if len(self.buf) < RECORD_HEADER.size:
            return None
        tag, length = RECORD_HEADER.unpack_from(self.buf)
        total = RECORD_HEADER.size + length + trailer_size(tag)
        if len(self.buf) < total:
            return None
        raw = bytes(self.buf[:total])
        del self.buf[:total]
        return tag, raw

    def _next_record(self) -> tuple[bytes, bytes] | None:
        """The next whole record in the buffer (seen by ``on_record`` once), or None."""
        if self._pending is not None:
            taken, self._pending = self._pending, None
            return taken
        taken = self._take_record()
        if taken is not None and self.on_record is not None:
            self.on_record(*taken)
        return taken

    def _fill(self, timeout: float | None) -> bool | None:
        """Read what arrived into the buffer: True; False when ``timeout`` passed first; None
        when the publisher is gone or dropped us (the connection is reset: the next call
        reconnects and resumes)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return False
        except OSError:
            data = b""
        if not data:
            self.reset()
            time.sleep(self.backoff)
            return None
        self.buf += data
        return True

    def _wait_for_version(
        self, have_version: int | None, deadline: float | None, epoch: int | None
    ) -> tuple[bytes, bytes] | None:
        """The next frame's version header record, or None when ``deadline`` passed first."""
        while True:
            if self.sock is None and not self._connect(have_version, deadline, epoch):
                return None
            taken = self._next_record()
            if taken is not None:
                if taken[0].upper() == TAG_VERSION:
                    return taken
                continue  # the tail of a frame whose start we did not see
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            if self._fill(remaining) is False:
                return None

    def next_frame(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: Floor | None = None,
    ) -> bytes | None:
        """The next whole frame, or None when none started within ``timeout``."""
        return joined_frame(self, have_version, timeout, epoch, floor)

    def next_records(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: Floor | None = None,
    ) -> Iterator[tuple[bytes, bytes]] | None:
        """The next frame as its raw ``(tag, record)`` pairs, yielded as they arrive (the
        end record last), or None when no frame started within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first = self._wait_for_version(have_version, deadline, epoch)
        return None if first is None else self._rest_of_frame(first)

    def _rest_of_frame(self, first: tuple[bytes, bytes]) -> Iterator[tuple[bytes, bytes]]:
        started, size = time.monotonic(), len(first[1])
        yield first
        while True:
            taken = self._next_record() if self.sock is not None else None
            if taken is None:
                got = self._fill(FRAME_STALL_S) if self.sock is not None else None
                if got:
                    continue
                if got is False:
                    self.reset()
                why = "went quiet" if got is False else "dropped the connection"
                raise FrameInterruptedError(f"{self.where} {why} in the middle of a frame; asking again")
            tag, raw = taken
            if tag.upper() == TAG_VERSION:  # the publisher gave this frame up and began the next
                self._pending = taken
                raise FrameInterruptedError(f"{self.where} began a new frame before this one ended")
            size += len(raw)
            if tag.upper() == TAG_END:  # the caller stops here: account for the frame first
                self.last_fetch_s, self.last_frame_bytes = time.monotonic() - started, size
            yield tag, raw
            if tag.upper() == TAG_END:
                return

    def close(self) -> None:
        self.reset()


def _why(exc: OSError) -> str:
    """A connection failure in words (``connection refused``, ``timed out``, ...)."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "connection timed out"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host ({exc.strerror})"
    return exc.strerror or type(exc).__name__
