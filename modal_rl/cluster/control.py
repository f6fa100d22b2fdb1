"""The control channel between rank 0 and its followers: newline-delimited JSON over TCP.

Why a channel of our own rather than only watching ``ray.nodes()``: the GCS marks a node
dead only after its health checks fail (about 15 s by default), and a dead node tells
nothing about *why*. Each follower keeps one connection to rank 0 and sends

    {"hello": rank}            once, on connect
    {"log": line}              every line its Ray node prints (rank 0 keeps the last ones)
    {"hb": t}                  every ``heartbeat_s``
    {"ray_exited": code}       when its Ray node's process ends on its own

and rank 0 sends ``{"head_up": true}`` once its own node is registered (followers start
Ray only then: joining a half-started head makes ``ray start`` back off for seconds, and
on a small host the head's start-up competes with theirs), ``{"joined": true}`` once every node is registered (until then a follower
restarts a Ray node that fails to come up, within the join timeout) and ``{"exit": code}``
when the job is over. A connection that closes
without an ``exit`` from rank 0, or that stays silent for ``lost_after_s``, is a lost
follower — reported with its rank and last lines within a second or two of the death.

Admission: on a Modal cluster the control port is reachable from every i6pn container of
the workspace, so a connection counts as a follower only after it proves the run's key:
rank 0 opens with ``{"challenge": <random nonce>}`` and the follower's ``hello`` carries
``proof`` = HMAC-SHA256(derive(run key, "control"), nonce | rank). A hello without a valid
proof is dropped before it can report logs, deaths or heartbeats. Until its hello is read a
connection holds an admission slot (``MAX_UNPROVEN``, ``MAX_UNPROVEN_PER_PEER``; at most
``HELLO_TIMEOUT_S``), so silent sockets cannot pile up or keep a follower out. Without a run key in the
environment (a bare local cluster on loopback) both ends are keyless and skip the proof.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

from modal_rl import wire_json
from modal_rl.admission import Admission
from modal_rl.retry import wait_for
from modal_rl.run_key import derive, run_key_or_none, same
from modal_rl.text_safety import clean

TAIL_LINES = 30
HELLO_TIMEOUT_S = 10.0
# Connections that have not proved the key yet (``modal_rl.admission``): a flood of silent
# sockets from one address evicts its own, never a follower that answers the challenge.
MAX_UNPROVEN = 64
MAX_UNPROVEN_PER_PEER = 8
MAX_HELLO = 1024  # {"hello": rank, "proof": 64 hex}
MAX_MESSAGE = 1 << 16  # a log line, a heartbeat; longer lines are a dropped connection
log = logging.getLogger(__name__)


def _message(raw: bytes, max_bytes: int) -> dict:
    """One control line as a JSON object, bounded (``wire_json``); ``WireError`` otherwise."""
    msg = wire_json.loads(raw, max_bytes=max_bytes, max_depth=4)
    if not isinstance(msg, dict):
        raise wire_json.WireError("a control line that is not a JSON object")
    return msg


def hello_proof(key: str, nonce: str, rank: int) -> str:
    return hmac.new(derive(key, "control"), f"{nonce}|{rank}".encode(), hashlib.sha256).hexdigest()


@dataclass
class FollowerState:
    rank: int
    connected_at: float | None = None
    last_seen: float = 0.0
    lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    lost: str | None = None  # why rank 0 considers this follower gone; None while healthy

    def tail(self) -> str:
        return (
            "\n".join(f"    [rank {self.rank}] {line}" for line in self.lines) or "    (no output received)"
        )


class ControlServer:
    """Rank 0's end. Runs inside rank 0's asyncio loop; ``failures()`` is polled by the supervisor."""

    def __init__(self, nodes: int, lost_after_s: float, key: str | None = None):
        self.key = key if key is not None else run_key_or_none()
        self.refused = 0  # connections dropped for a missing or wrong proof
        self.followers = {r: FollowerState(r) for r in range(1, nodes)}
        self.lost_after_s = lost_after_s
        self.closing = False
        self.head_up = False
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._server: asyncio.base_events.Server | None = None
        self.unproven = Admission(MAX_UNPROVEN, MAX_UNPROVEN_PER_PEER, "control-channel connection")

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(
            self._handle, host=host, port=port, reuse_address=True, limit=MAX_MESSAGE
        )

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state: FollowerState | None = None
        nonce = secrets.token_hex(16)
        slot = self.unproven.hold(writer, reader)
        try:
            writer.write((json.dumps({"challenge": nonce}) + "\n").encode())
            try:
                raw = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            finally:
                self.unproven.release(slot)
            if slot.evicted:  # logged once by the admission, not as a refused hello
                return
            hello = _message(raw or b"null", MAX_HELLO)
            if not self._admitted(hello, nonce):
                self.refused += 1
                log.warning(
                    "control channel: refused a connection (no valid hello from a rank of this cluster)"
                )
                return
            state = self.followers[int(hello["hello"])]
            state.connected_at = state.last_seen = time.monotonic()
            state.lost = None
            self._writers[state.rank] = writer
            if self.head_up:  # a late follower still needs the go signal
                writer.write(b'{"head_up": true}\n')
            while True:
                raw = await reader.readline()
                if not raw:
                    break
                msg = _message(raw, MAX_MESSAGE)
                state.last_seen = time.monotonic()
                if "log" in msg:
                    state.lines.append(clean(msg["log"], multiline=True))
                elif "ray_exited" in msg and not self.closing:
                    state.lost = f"its Ray node exited with code {msg['ray_exited']}"
        except ValueError as exc:  # a refused line (WireError), or one over the reader's limit
            self.refused += state is None
            why = exc if isinstance(exc, wire_json.WireError) else f"a line over {MAX_MESSAGE} bytes"
            log.warning("control channel: dropped a connection: %s", clean(why))
        except (ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:
            # The loop is shutting down; finishing normally keeps asyncio from logging it.
            pass
        finally:
            if state is not None and not self.closing and state.lost is None:
                state.lost = "its node process died (control connection closed)"
            if state is not None:
                self._writers.pop(state.rank, None)
            writer.close()

    def _admitted(self, hello, nonce: str) -> bool:
        """A hello from a rank this cluster has, with a valid proof when the run has a key."""
        rank = hello.get("hello") if isinstance(hello, dict) else None
        if not isinstance(rank, int) or isinstance(rank, bool):
            return False
        if hello["hello"] not in self.followers:
            return False  # a rank this cluster does not have
        if self.key is None:
            return True
        proof = hello.get("proof")
        return isinstance(proof, str) and same(proof, hello_proof(self.key, nonce, hello["hello"]))

    def failures(self) -> list[FollowerState]:
        """Followers that are gone: closed, reported a dead Ray node, or silent too long."""
        now = time.monotonic()
        for state in self.followers.values():
            silent = now - state.last_seen
            if state.connected_at is not None and state.lost is None and silent > self.lost_after_s:
                state.lost = f"no heartbeat for {silent:.1f} s"
        return [s for s in self.followers.values() if s.lost]

    async def announce_head_up(self) -> None:
        self.head_up = True
        await self.broadcast({"head_up": True})

    async def broadcast(self, msg: dict) -> None:
        for writer in list(self._writers.values()):
            try:
                writer.write((json.dumps(msg) + "\n").encode())
                await asyncio.wait_for(writer.drain(), 2.0)
            except (ConnectionError, TimeoutError):
                pass

    async def release(self, code: int) -> None:
        """Tell every connected follower to stop its Ray node and exit."""
        self.closing = True
        await self.broadcast({"exit": code})
        if self._server is not None:
            self._server.close()


class ControlClient:
    """A follower's end: a socket plus a lock, because log lines come from a reader thread."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        connect_timeout_s: float,
        heartbeat_s: float = 1.0,
        key: str | None = None,
    ):
        key = key if key is not None else run_key_or_none()
        errors: list[OSError] = []

        def connect() -> socket.socket | None:
            try:
                return socket.create_connection((host, port), timeout=2.0)
            except OSError as exc:  # rank 0 not listening yet: try again until the deadline
                errors.append(exc)
                return None

        sock = wait_for(connect, connect_timeout_s, poll_s=0.1)
        if sock is None:
            raise ConnectionError(  # wait_for tried at least once: an error is there
                f"rank {rank}: could not reach rank 0's control port {host}:{port}: {errors[-1]}"
            )
        self.sock = sock
        self.sock.settimeout(None)
        self._lock = threading.Lock()
        self._buffer = b""
        self.broken = threading.Event()
        challenge = self.poll(HELLO_TIMEOUT_S)
        if not isinstance(challenge, dict) or "challenge" not in challenge:
            self.close()
            raise ConnectionError(f"rank {rank}: rank 0's control port {host}:{port} sent no challenge")
        hello: dict = {"hello": rank}
        if key is not None:
            hello["proof"] = hello_proof(key, str(challenge["challenge"]), rank)
        self.send(hello)
        # Heartbeats from their own thread: the follower's main thread blocks for many
        # seconds at a time (waiting for the head's GCS, starting Ray) and must not look dead.
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True)
        self._beat.start()

    def _heartbeat(self, period_s: float) -> None:
        while not self.broken.is_set():
            if not self.send({"hb": time.time()}):
                self.broken.set()
            self.broken.wait(period_s)

    def send(self, msg: dict) -> bool:
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                self.broken.set()
                return False

    def poll(self, timeout_s: float) -> dict | None | bool:
        """One message from rank 0, ``None`` on timeout, ``False`` when the connection closed."""
        if b"\n" not in self._buffer:
            self.sock.settimeout(timeout_s)
            try:
                chunk = self.sock.recv(4096)
            except TimeoutError:
                return None
            except OSError:
                return False
            if not chunk:
                return False
            self._buffer += chunk
            if b"\n" not in self._buffer:
                if len(self._buffer) > MAX_MESSAGE:
                    log.warning("control channel: rank 0 sent a line over %d bytes", MAX_MESSAGE)
                    return False
                return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return _message(line, MAX_MESSAGE)
        except wire_json.WireError as exc:
            log.warning("control channel: rank 0 sent a line this follower refuses (%s)", exc)
            return False

    def close(self) -> None:
        self.broken.set()
        with contextlib.suppress(OSError):
            self.sock.close()
