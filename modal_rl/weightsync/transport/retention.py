"""What a frame server keeps for receivers that connect late or reconnect.

A server retains the frames of its newest epoch back to its ``keep_anchors``-th newest anchor
(``trim``), each as the records it sent. A receiver that connects says which version and
epoch it holds; ``kept_since`` answers by the catch-up rule (``weightsync.catchup``), weighing
frames by their bytes. Recovery anchors are retained for catch-up only, never broadcast.
"""

from __future__ import annotations

from typing import NamedTuple

from modal_rl.weightsync.catchup import CannotCatchUp, Held, Retained, catch_up
from modal_rl.weightsync.wire.frames import VersionHeader


class Kept(NamedTuple):
    """A retained frame as its records (kept as sent: joining them would hold a model-sized
    frame twice); ``recovery``: a recovery anchor (catch-up only, never broadcast)."""

    header: VersionHeader
    records: list[bytes]
    recovery: bool = False

    @property
    def size(self) -> int:
        return sum(map(len, self.records))


def trim(retained: list[Kept], keep_anchors: int) -> None:
    """Drop what lies before the ``keep_anchors``-th newest anchor (0: keep nothing)."""
    if keep_anchors == 0:
        retained.clear()
        return
    anchors = [i for i, k in enumerate(retained) if k.header.kind == "anchor"]
    if len(anchors) > keep_anchors:
        del retained[: anchors[-keep_anchors]]


def kept_since(retained: list[Kept], have: int | None, epoch: int | None) -> list[Kept]:
    """What a receiver at ``(epoch, have)`` lacks, of the newest retained epoch (``catch_up``;
    nothing when it cannot catch up from what is retained, e.g. it is ahead)."""
    views = [
        Retained(h.kind, h.version, h.epoch, h.base_version, k.size, k.recovery, h.base_digest)
        for k in retained
        for h in (k.header,)
    ]
    plan = catch_up(None if have is None else Held(have, epoch), views)
    return [] if isinstance(plan, CannotCatchUp) else [retained[i] for i in plan]
