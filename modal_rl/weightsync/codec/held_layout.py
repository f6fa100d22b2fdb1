"""A receiver's delta layout: the per-tensor work of applying a delta, done once.

A delta's group records are the same bytes every version (they name tensors, never sums),
and the held tensors stay the same objects between anchors. ``HeldLayout`` keeps, per group
position of the last delta: its record body, the parsed header, the held tensors it
resolved to and their word views, and the segments as int64 tables (addresses, sizes,
group-local offsets) that one compiled pass walks per chunk (``fused.apply_table``). A
later delta whose group body is byte-equal and whose held tensors are the same objects
reuses all of it; anything else takes the checked path and is remembered after.

It also keeps the held sums as lanes (``sum_lanes``) with their digest, valid while the
caller hands back the sums the last delta produced (compared as a dict: equal strings).

Invariants: an anchor makes the layout forget everything (``forget``), so it never holds
a replaced state alive; a cached group is used only after the identity check of every held tensor it
names, so a swapped-in tensor (an anchor) never meets a stale address; the layout is
advisory — dropping it (``HeldLayout()``) changes only speed, never a result.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from modal_rl.weightsync.codec import sum_lanes
from modal_rl.weightsync.wire.frames import GroupHeader


@dataclass
class HeldGroup:
    body: bytes
    header: GroupHeader
    names: list[str]
    held: list[Any]  # the held tensors, by identity
    segments: list[tuple[int, Any]]
    table: tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype] | None  # addresses, sizes, offsets, word
    empty_sums: dict[str, str]
    total: int  # the group's words


class HeldLayout:
    """See the module docstring."""

    def __init__(self) -> None:
        self.groups: list[HeldGroup] = []
        self.names: list[str] = []  # the last delta's tensors, in frame order
        self.digest: sum_lanes.SortedDigest | None = None  # for ``names``
        self.lanes: tuple[np.ndarray, np.ndarray] | None = None  # the sums it produced
        self.sums: dict[str, str] | None = None
        self.sums_digest: str | None = None

    def forget(self) -> None:
        """Drop everything kept (an anchor replaces the held tensors: the layout must not keep
        the old ones alive beside the new)."""
        self.groups.clear()
        self.names, self.digest = [], None
        self.lanes = self.sums = self.sums_digest = None

    def group(self, k: int, body: bytes, state) -> HeldGroup | None:
        """Group position ``k``'s cached layout when ``body`` equals it and it still names
        the held tensors (the same objects); else None."""
        if k >= len(self.groups):
            return None
        g = self.groups[k]
        if g.body != body:
            return None
        get = state.get
        if not all(map(operator.is_, map(get, g.names), g.held)):
            return None
        return g

    def remember(self, k: int, body: bytes, header: GroupHeader, state, segments) -> HeldGroup:
        names = [th.name for th in header.tensors]
        table = None
        words = [w for _, w in segments]
        first = words[0] if words else None
        if all(
            isinstance(w, np.ndarray)
            and w.dtype == first.dtype
            and w.flags.c_contiguous
            and w.flags.writeable
            for w in words
        ):
            table = (
                np.array([w.__array_interface__["data"][0] for w in words], np.int64),
                np.array([w.size for w in words], np.int64),
                np.array([s for s, _ in segments], np.int64),
                first.dtype,
            )
        g = HeldGroup(
            bytes(body),
            header,
            names,
            [state[n] for n in names],
            segments,
            table,
            {th.name: th.checksum for th in header.tensors},
            header.total,
        )
        del self.groups[k:]
        self.groups.append(g)
        return g

    def held_lanes(self, held_checksums) -> tuple[np.ndarray, np.ndarray] | None:
        """The held sums as lanes when ``held_checksums`` are the ones the last delta made."""
        if self.lanes is not None and held_checksums == self.sums:
            return self.lanes
        return None

    def finish(self, names: list[str], a: np.ndarray, c: np.ndarray) -> tuple[dict[str, str], str]:
        """A delta's new sums, as hex by name and their digest; kept for the next delta."""
        if names != self.names or self.digest is None:
            self.names, self.digest = names, sum_lanes.SortedDigest(names)
        sums = dict(zip(names, sum_lanes.to_hex(a, c), strict=True))
        digest = self.digest.digest(a, c)
        return sums, digest

    def keep(self, a: np.ndarray, c: np.ndarray, sums: dict[str, str], digest: str) -> None:
        self.lanes, self.sums, self.sums_digest = (a, c), sums, digest
