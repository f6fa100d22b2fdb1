"""VersionChain: a receiver's verified policy state and the frames that rebuild it.

Invariants:
- ``state`` is bit-identical to the sender's tensors at ``version``: every tensor of every
  accepted frame was checked against the sender's ls128 of the new state (``codec.linsum``:
  anchors summed in full, deltas by the sums their changes moved). ``audit()`` sums the held
  state in full and, if a tensor no longer matches its sum (damaged outside any delta's
  reach), forgets the held version so that only an anchor is accepted next.
- A refused frame (any ``WeightSyncError``) leaves ``state``, ``version`` and ``checksums``
  exactly as they were.
- With a key (the default: the run's key from the environment), only frames signed with
  it are accepted, every record verified before use; ``key=None`` accepts only unsigned
  frames.
- Frames are ordered by ``(epoch, version)`` (``epoch``): a frame of an older epoch than
  the held one is refused (``StaleEpochError``: its trainer was replaced), a frame of a newer
  epoch must be an anchor (``EpochMismatchError`` for a delta) and replaces the held state
  whatever its version, dropping every retained frame of the old epoch; within an epoch,
  versions strictly increase. Once a run is held, frames of another run are refused
  (``ForeignRunError``).
- With ``retain=True`` the chain keeps every frame from its ``keep_anchors``-th newest
  anchor on, so ``rebuild(v)`` reproduces any retained version v from its last anchor plus
  the deltas after it, and a peer that fell behind can be served from ``frames_since``.
- A ``floor_epoch`` (a receiver told which epoch is current, e.g. by a signed pull) refuses
  frames of older epochs before anything is staged (``RolledBackError``).

A store's untrusted files are read by ``frame_file.read_frame_file``.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from modal_rl.weightsync.catchup import CannotCatchUp, Held, Retained, catch_up
from modal_rl.weightsync.codec.decode import ApplyResult, apply_frame
from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.codec.held_layout import HeldLayout
from modal_rl.weightsync.errors import (
    BaseMismatchError,
    EpochMismatchError,
    ForeignRunError,
    RolledBackError,
    StaleEpochError,
    StaleVersionError,
)
from modal_rl.weightsync.wire.auth import FROM_ENV, frame_keys
from modal_rl.weightsync.wire.epoch import describe
from modal_rl.weightsync.wire.frames import VersionHeader


def frame_bytes(frame: bytes | bytearray | memoryview | Iterable[bytes]) -> bytes:
    """A whole frame as bytes, from bytes or from an iterable of records."""
    if isinstance(frame, bytes | bytearray | memoryview):
        return bytes(frame)
    return b"".join(frame)


class VersionChain:
    def __init__(
        self, config: CodecConfig | None = None, *, retain: bool = True, keep_anchors: int = 1, key=FROM_ENV
    ) -> None:
        if keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1")
        self.config = config or CodecConfig()
        self.keys = frame_keys(key)
        self.retain = retain
        self.keep_anchors = keep_anchors
        self.state: dict[str, Any] = {}
        self.version: int | None = None
        self.epoch: int | None = None
        self.run: str | None = None
        self.checksums: dict[str, str] = {}
        self.floor_epoch: int | None = None  # frames of older epochs are refused (see above)
        self._frames: dict[int, tuple[VersionHeader, bytes]] = {}
        # the held state's delta layout, reused from delta to delta (``held_layout``)
        self._layout = HeldLayout()

    def apply(self, frame: bytes | Iterable[bytes] | BinaryIO) -> ApplyResult:
        """Accept the next frame (an anchor, or a delta whose base is the held version)."""
        data = frame.read() if hasattr(frame, "read") else frame_bytes(frame)
        result = self._apply(io.BytesIO(data))
        self._accept(result, data)
        return result

    def apply_records(self, raw_records: Iterator[tuple[bytes, bytes]]) -> ApplyResult:
        """``apply`` for a frame still arriving, as its raw ``(tag, record)`` pairs (a
        ``TcpSource``'s ``next_records``): each chunk is decoded as it arrives, so a version
        costs about its slowest stage rather than wire plus decode. The same invariants
        hold: order is checked on the version header before anything is decoded, and a
        frame that fails — or is cut off (``FrameInterruptedError``) — leaves the state as it
        was. Only for a chain that retains no frames (there is no whole frame to keep)."""
        if self.retain:
            raise ValueError("a chain that retains frames needs them whole: use apply()")
        result = self._apply(raw_records)
        self._accept(result, None)
        return result

    def _apply(self, stream: BinaryIO | Iterator[tuple[bytes, bytes]]) -> ApplyResult:
        """Decode one frame onto the held state; its order is checked on its (verified)
        version header before anything is decoded."""
        return apply_frame(
            self.state,
            stream,
            held_version=self.version,
            held_checksums=self.checksums,
            config=self.config,
            key=self.keys,
            check_header=self.check_order,
            layout=self._layout,
        )

    def _accept(self, result: ApplyResult, data: bytes | None) -> None:
        header = result.header
        if result.state is not None:  # an anchor: swap in the freshly built tensors
            self.state = result.state
        if header.epoch != self.epoch:  # a new epoch: the old one's frames are history
            self._frames.clear()
        self.version, self.epoch, self.run = header.version, header.epoch, header.run
        self.checksums = dict(result.checksums)
        if self.retain:
            self._frames[header.version] = (header, data)
            self._prune()

    def check_order(self, header: VersionHeader) -> None:
        """Raise unless ``header`` may follow the held state (see the module invariants)."""
        if self.run is not None and header.run != self.run:
            raise ForeignRunError(f"frame of run {header.run!r}; this receiver follows run {self.run!r}")
        if self.floor_epoch is not None and header.epoch < self.floor_epoch:
            raise RolledBackError(
                f"frame v{header.version} is from epoch {describe(header.epoch)}, older than this "
                f"receiver's floor epoch {describe(self.floor_epoch)}: a rolled-back source"
            )
        if self.epoch is not None and header.epoch < self.epoch:
            raise StaleEpochError(
                f"frame v{header.version} is from epoch {describe(header.epoch)}, older than the held "
                f"epoch {describe(self.epoch)}: its trainer was replaced"
            )
        new_epoch = self.epoch is None or header.epoch > self.epoch
        if header.kind == "delta" and self.version is None:
            raise BaseMismatchError(f"delta {header.base_version}→{header.version} needs an anchor first")
        if header.kind == "delta" and new_epoch:
            raise EpochMismatchError(
                f"delta {header.base_version}→{header.version} of epoch {describe(header.epoch)} does not "
                f"apply to epoch {describe(self.epoch)}: a new epoch starts with its anchor"
            )
        if not new_epoch and self.version is not None and header.version <= self.version:
            raise StaleVersionError(
                f"frame for version {header.version} is not newer than held {self.version}"
            )

    def audit(self) -> list[str]:
        """Sum every held tensor in full against the sum the chain keeps for it (a pass over
        the held state: what a delta's moved sums cannot see). Returns the tensors that do
        not match; when there are any, the held version is forgotten (the next frame must be
        an anchor), so a damaged state is never the base of another delta."""
        from modal_rl.weightsync.codec.chunk_sums import held_sums

        if self.version is None:
            return []
        actual = held_sums(self.state)
        damaged = sorted(name for name, s in actual.items() if self.checksums.get(name) != s)
        if damaged:
            self.version, self.checksums = None, {}
            self._frames.clear()
        return damaged

    @property
    def position(self) -> tuple[int, int]:
        """What is held, in the order receivers keep: (epoch, version); see ``epoch``."""
        from modal_rl.weightsync.wire.epoch import position

        return position(self.epoch, self.version)

    def _prune(self) -> None:
        anchors = sorted(v for v, (h, _) in self._frames.items() if h.kind == "anchor")
        if len(anchors) > self.keep_anchors:
            oldest_kept = anchors[-self.keep_anchors]
            for v in [v for v in self._frames if v < oldest_kept]:
                del self._frames[v]

    @property
    def retained_versions(self) -> list[int]:
        return sorted(self._frames)

    def frames_since(self, version: int | None) -> list[bytes]:
        """Frames that bring a peer at ``version`` of the held epoch (None: nothing) to the
        held version, by the catch-up rule (``weightsync.catchup``): the deltas after it when
        they follow it, else the last anchor and its deltas."""
        held = None if version is None else Held(version, self.epoch)
        plan = self._plan(held, self.version)
        return [] if isinstance(plan, CannotCatchUp) else [data for _, data in plan]

    def _plan(self, held: Held | None, upto: int | None) -> list[tuple[VersionHeader, bytes]] | CannotCatchUp:
        """The retained frames ``catch_up`` gives a peer at ``held`` to reach ``upto``."""
        frames = [self._frames[v] for v in self.retained_versions if upto is not None and v <= upto]
        views = [
            Retained(h.kind, h.version, h.epoch, h.base_version, 0, False, h.base_digest) for h, _ in frames
        ]
        plan = catch_up(held, views)
        return plan if isinstance(plan, CannotCatchUp) else [frames[i] for i in plan]

    def rebuild(self, version: int) -> dict[str, Any]:
        """Fresh tensors of a retained version: its last anchor, then the deltas after it."""
        if version not in self._frames:
            raise KeyError(f"version {version} is not retained (retained: {self.retained_versions})")
        plan = self._plan(None, version)
        if isinstance(plan, CannotCatchUp):
            raise KeyError(f"version {version} cannot be rebuilt from what is retained: {plan.reason}")
        scratch = VersionChain(self.config, retain=False, key=self.keys)
        for _, data in plan:
            scratch.apply(data)
        return scratch.state
