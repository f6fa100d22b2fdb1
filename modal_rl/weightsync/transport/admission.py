"""Admission slots for connections still in their handshake (the frame server's slowloris guard).

A connection holds a slot from accept until its handshake ends (admitted, refused, left or
timed out). ``Admission.hold`` keeps at most ``per_peer`` slots per peer address and ``total``
in all: a new connection over a cap evicts the oldest slot — of its own peer first, so one
peer's flood evicts only its own sockets — by aborting its transport (its pending read ends
at once). Slots are kept oldest first (a dict keeps insertion order).

Invariant: ``len(slots) <= total`` and no peer holds more than ``per_peer`` after ``hold``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

log = logging.getLogger("modal_rl.weightsync.transport.tcp")


@dataclass
class Slot:
    writer: asyncio.StreamWriter
    host: str
    evicted: bool = False


class Admission:
    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.slots: dict[int, Slot] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.slots)

    def hold(self, writer: asyncio.StreamWriter) -> Slot:
        peername = writer.get_extra_info("peername")
        host = str(peername[0]) if isinstance(peername, tuple) and peername else str(peername)
        same_peer = [s for s in self.slots.values() if s.host == host]
        if len(same_peer) >= self.per_peer:
            self._evict(same_peer[0], f"over {self.per_peer} per peer")
        if len(self.slots) >= self.total:
            self._evict(next(iter(self.slots.values())), f"over {self.total} in all")
        slot = Slot(writer, host)
        self.slots[id(slot)] = slot
        return slot

    def release(self, slot: Slot) -> None:
        self.slots.pop(id(slot), None)

    def _evict(self, slot: Slot, why: str) -> None:
        self.release(slot)
        slot.evicted = True
        self.evicted += 1
        transport = slot.writer.transport
        if transport is not None:
            transport.abort()
        log.info("weight-sync receiver %s evicted before its handshake ended (%s)", slot.host, why)
