"""Admission slots for connections that have not proved anything yet (every server we run).

A connection holds a slot from accept until it is admitted (its handshake passed, or its
first request's headers arrived), refused, left, or its deadline passed. ``Admission.hold``
keeps at most ``per_peer`` slots per peer address and ``total`` in all; a connection over a
cap evicts one slot by aborting its transport (its pending read ends at once):

- over the per-peer cap, a slot of the *same* peer goes, so one address's flood evicts only
  its own sockets; over the total cap, a slot of the peer holding the most;
- of those, the oldest that is *stalled* goes first: one with no byte waiting in the kernel
  and no whole line read. A client that holds the key sends its line at once, so while a
  flood of silent or half-sent sockets from its own address (every local client shares
  127.0.0.1) fills the cap, the flood's sockets are the ones evicted, not the keyed client's
  (``tests/core/test_admission_floods.py``). A slot whose line the server answered (a challenge
  sent, ``progressed``) counts as progressing for ``ANSWER_GRACE_S``, while its peer answers.
  Only when every candidate has progressed does the oldest go: a keyless flood of whole,
  well-formed hellos that never prove anything still competes with a keyed client of its own
  address during that round trip (telling them apart needs a keyed first line).

Invariant: ``len(slots) <= total`` and no peer holds more than ``per_peer`` after ``hold``.
"""

from __future__ import annotations

import array
import fcntl
import logging
import termios
import time
from dataclasses import dataclass, field

log = logging.getLogger("modal_rl.admission")
# A keyed client answers a challenge within one round trip; a keyless one that wrote a whole
# hello but never proves anything is stalled again after this long.
ANSWER_GRACE_S = 1.0


@dataclass
class Slot:
    transport: object
    host: str
    reader: object = None
    since: float = field(default_factory=time.monotonic)
    answered: float | None = None  # when the server last answered it (``progressed``)
    evicted: bool = False


class Admission:
    def __init__(self, total: int, per_peer: int, what: str = "connection") -> None:
        self.total, self.per_peer, self.what = total, per_peer, what
        self.slots: dict[int, Slot] = {}  # oldest first (a dict keeps insertion order)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.slots)

    def hold(self, conn, reader=None) -> Slot:
        """A slot for ``conn`` (an ``asyncio.StreamWriter`` or a transport); ``reader``: its
        ``StreamReader``, if any, so that a line already read counts as progress."""
        transport = getattr(conn, "transport", conn)
        slot = Slot(transport, peer_host(transport), reader)
        same_peer = [s for s in self.slots.values() if s.host == slot.host]
        if len(same_peer) >= self.per_peer:
            self._evict(_victim(same_peer), f"over {self.per_peer} per peer")
        if len(self.slots) >= self.total:
            counts: dict[str, int] = {}
            for s in self.slots.values():
                counts[s.host] = counts.get(s.host, 0) + 1
            busiest = max(counts, key=counts.__getitem__)
            self._evict(
                _victim([s for s in self.slots.values() if s.host == busiest]), f"over {self.total} in all"
            )
        self.slots[id(slot)] = slot
        return slot

    def progressed(self, conn) -> None:
        """``conn`` sent a whole first line and the server answered it: for ``ANSWER_GRACE_S``
        it counts as progressing while its peer answers (one round trip for a keyed one)."""
        transport = getattr(conn, "transport", conn)
        for slot in self.slots.values():
            if slot.transport is transport:
                slot.answered = time.monotonic()

    def release(self, slot: Slot) -> None:
        self.slots.pop(id(slot), None)

    def release_transport(self, transport) -> None:
        """Release the slot of ``transport`` (a server that learns of admission per request)."""
        for key, slot in list(self.slots.items()):
            if slot.transport is transport:
                self.slots.pop(key, None)

    def _evict(self, slot: Slot, why: str) -> None:
        self.release(slot)
        slot.evicted = True
        self.evicted += 1
        abort = getattr(slot.transport, "abort", None)
        if abort is not None:
            abort()
        log.info("%s from %s evicted before it was admitted (%s)", self.what, slot.host, why)


def peer_host(transport) -> str:
    peername = transport.get_extra_info("peername") if hasattr(transport, "get_extra_info") else None
    return str(peername[0]) if isinstance(peername, tuple) and peername else str(peername)


def _victim(slots: list[Slot]) -> Slot:
    """The oldest stalled slot of ``slots`` (oldest first), else the oldest."""
    return next((s for s in slots if not _progressing(s)), slots[0])


def _progressing(slot: Slot) -> bool:
    if slot.answered is not None and time.monotonic() - slot.answered < ANSWER_GRACE_S:
        return True
    buffer = getattr(slot.reader, "_buffer", None)  # StreamReader keeps what it read here
    if buffer is not None and b"\n" in buffer:
        return True
    sock = slot.transport.get_extra_info("socket") if hasattr(slot.transport, "get_extra_info") else None
    if sock is None:
        return False
    waiting = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting, True)
    except OSError:
        return False
    return waiting[0] > 0
