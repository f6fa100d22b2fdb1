"""What a frame server keeps for receivers that connect late or reconnect.

A server retains the frames of its newest epoch back to its ``keep_anchors``-th newest anchor
(``trim``), each as the records it sent. A receiver that connects says which version and
epoch it holds; ``kept_since`` answers with the deltas after its version when it holds the
server's epoch and they weigh less than the newest anchor's path, else that anchor and the
deltas after it. Recovery anchors are retained for catch-up only, never broadcast.
"""

from __future__ import annotations

from typing import NamedTuple

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
    """What a receiver at ``(epoch, have)`` lacks, of the newest retained epoch (see
    ``FrameServer.frames_since``)."""
    if not retained:
        return []
    cur = retained[-1].header.epoch
    kept = [k for k in retained if k.header.epoch == cur]
    if epoch is not None and epoch > cur:
        return []
    same = epoch is None or epoch == cur
    anchors = [i for i, k in enumerate(kept) if k.header.kind == "anchor"]
    cold = [kept[anchors[-1]]] if anchors else []
    if anchors:
        cold += [k for k in kept[anchors[-1] + 1 :] if not k.recovery]
    versions = [k.header.version for k in kept]
    if same and have is not None and have in versions:
        warm = [k for k in kept[versions.index(have) + 1 :] if not k.recovery]
        if not cold or sum(k.size for k in warm) <= sum(k.size for k in cold):
            return warm
        return cold
    if same and have is not None and versions and have >= versions[-1]:
        return []
    return cold
