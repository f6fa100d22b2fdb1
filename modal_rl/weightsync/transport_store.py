"""Store transport: publish/subscribe through a directory, or a Modal Volume.

Layout under ``root``:

    frames/<epoch:016x>-<version:012d>.<anchor|delta>   one frame per version (and kind)
    latest                                              JSON {"run", "epoch", "version", "kind", "anchor"}
    lease                                               the publisher's lease (``lease``)

Invariants:
- a frame file appears under its final name only when complete (written to a temporary
  name, fsynced, renamed), and ``latest`` is advanced only after the frame is durable —
  for a Modal Volume, after ``commit()`` returned — so a reader never sees a pointer to
  bytes that are not there;
- one publisher at a time: ``open_epoch`` takes the store's lease (``lease.StoreLease``) and
  every write renews it first; a publisher whose lease was taken raises ``LeaseLostError``
  before it writes anything more;
- readers ``reload()`` before looking and follow ``latest``'s epoch only: a receiver of that
  epoch takes the deltas after its version; any other receiver (cold, restarted, of an old
  epoch, or one for whom the deltas weigh more) takes the newest anchor at or below
  ``latest`` — a wire anchor or a recovery anchor (``send_recovery``) — and the deltas after
  it: at most one anchor window, never the whole chain;
- garbage collection keeps the ``keep_anchors`` newest anchor windows (default 2: the
  current one and the previous one, which a receiver may still be reading), across epochs
  in ``(epoch, version)`` order; older frames are deleted after the pointer moved;
- with a key (the default: the run's key from the environment) every frame and the lease
  are written signed, and a ``Subscriber`` reading the store accepts only frames whose every
  record's MAC matches that key — a file altered on the disk or volume, even with its
  checksums recomputed, is refused; ``key=None`` is the explicit keyless mode.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from modal_rl.weightsync.auth import FROM_ENV, frame_keys, sign_records
from modal_rl.weightsync.frames import VersionHeader
from modal_rl.weightsync.lease import StoreLease

POLL_S = 0.05


class DirectoryStore:
    """FrameSink and FrameSource over a directory (local disk, NFS, or a mounted volume).

    ``lease_ttl_s``: how long a publisher's lease lives without a heartbeat;
    ``lease_wait_s``: how long a new publisher waits for a live lease to lapse before it is
    refused (default: the ttl, so a trainer restarted on another host takes over once the
    dead one's lease lapsed)."""

    def __init__(
        self,
        root: str | Path,
        *,
        key=FROM_ENV,
        keep_anchors: int = 2,
        lease_ttl_s: float = 30.0,
        lease_wait_s: float | None = None,
        heartbeat: bool = True,
    ) -> None:
        if keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1")
        self.keys = frame_keys(key)
        self.root = Path(root)
        self.frames_dir = self.root / "frames"
        self.frames_dir.mkdir(parents=True, exist_ok=True)
        self.keep_anchors = keep_anchors
        self.lease = StoreLease(
            self.root,
            self.keys,
            lambda path, data: (self._write_atomic(path, [data]), self.after_write()),
            self.before_read,
            ttl_s=lease_ttl_s,
            heartbeat=heartbeat,
        )
        self.lease_wait_s = lease_ttl_s if lease_wait_s is None else lease_wait_s
        self.epoch: int | None = None
        self.last_fetch_s = 0.0
        self.bytes_read = 0  # every frame byte this reader fetched (what catching up cost)
        self.frames_read: list[tuple[int, int, str]] = []  # (epoch, version, kind) fetched

    # Hooks a networked store overrides (see ModalVolumeStore).
    def after_write(self) -> None:
        """Make everything written so far durable for other readers."""

    def before_read(self) -> None:
        """See everything other writers made durable."""

    def _write_atomic(self, path: Path, chunks: Iterable[bytes]) -> int:
        tmp = path.with_name(f".{path.name}.partial")
        size = 0
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return size

    def frame_path(self, epoch: int, version: int, kind: str) -> Path:
        return self.frames_dir / f"{epoch:016x}-{version:012d}.{kind}"

    # -- publisher side ----------------------------------------------------------------
    def open_epoch(self, run: str, epoch: int) -> int:
        """Take the lease (``LeaseHeldError`` while another publisher's is live); the epoch to
        publish, above every epoch this store has seen."""
        seen = [e for e, _, _, _ in self._listing()] + [self.latest().get("epoch") or 0]
        self.epoch = self.lease.acquire(run, epoch, wait_s=self.lease_wait_s, after_epoch=max(seen))
        return self.epoch

    def _check_epoch(self, header: VersionHeader) -> None:
        if self.epoch is None:  # a sink used without a Publisher: take the lease now
            self.open_epoch(header.run, header.epoch)
        if header.epoch != self.epoch:
            raise ValueError(
                f"frame of epoch {header.epoch:x}; this store's publisher holds epoch {self.epoch:x}"
            )
        self.lease.renew()

    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        self._check_epoch(header)
        path = self.frame_path(header.epoch, header.version, header.kind)
        size = self._write_atomic(path, sign_records(records, self.keys))
        self.after_write()  # the frame is durable before anything points at it
        self.lease.renew(write=False)  # lost meanwhile: the pointer does not move to our frame
        latest = self.latest()
        anchor = header.version if header.kind == "anchor" else latest.get("anchor")
        pointer = {"run": header.run, "epoch": header.epoch, "version": header.version}
        self._write_atomic(
            self.root / "latest", [json.dumps(pointer | {"kind": header.kind, "anchor": anchor}).encode()]
        )
        self.after_write()
        self._prune()
        return size

    def send_recovery(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """A recovery anchor of a version already published (see ``Publisher``): written
        beside its delta; the pointer's ``anchor`` moves to it; live readers never need it."""
        self._check_epoch(header)
        size = self._write_atomic(
            self.frame_path(header.epoch, header.version, "anchor"), sign_records(records, self.keys)
        )
        self.after_write()
        latest = self.latest()
        if latest.get("epoch") == header.epoch and latest.get("version") == header.version:
            self._write_atomic(
                self.root / "latest", [json.dumps(latest | {"anchor": header.version}).encode()]
            )
            self.after_write()
        self._prune()
        return size

    def _listing(self) -> list[tuple[int, int, str, Path]]:
        """(epoch, version, kind, path) of every frame file, in (epoch, version) order."""
        out = []
        for path in self.frames_dir.iterdir():
            stem, _, kind = path.name.partition(".")
            epoch, _, version = stem.partition("-")
            if kind in ("anchor", "delta") and version.isdigit() and len(epoch) == 16:
                try:
                    out.append((int(epoch, 16), int(version), kind, path))
                except ValueError:
                    continue
        return sorted(out, key=lambda e: (e[0], e[1], e[2] == "anchor"))

    def _prune(self) -> None:
        listing = self._listing()
        anchors = [(e, v) for e, v, kind, _ in listing if kind == "anchor"]
        if len(anchors) > self.keep_anchors:
            oldest_kept = anchors[-self.keep_anchors]
            for e, v, _, path in listing:
                if (e, v) < oldest_kept:
                    path.unlink(missing_ok=True)
            self.after_write()

    def close(self) -> None:
        """Release the lease if this store published (readers hold none)."""
        self.lease.release()

    # -- subscriber side ---------------------------------------------------------------
    def latest(self) -> dict[str, Any]:
        try:
            data = json.loads((self.root / "latest").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def plan(self, have: int | None, epoch: int | None = None) -> list[Path]:
        """The frame files that bring a receiver at ``(epoch, have)`` to ``latest``: the deltas
        after ``have`` when the receiver holds ``latest``'s epoch and they are all there and
        weigh less than the newest anchor's path; else that anchor and the deltas after it."""
        latest = self.latest()
        target, cur = latest.get("version"), latest.get("epoch")
        if target is None or cur is None:
            return []
        if epoch is not None and epoch > cur:
            return []  # the receiver is ahead of this pointer (a stale store): nothing to give
        if epoch == cur and have is not None and have >= target:
            return []
        frames = [(v, kind, p) for e, v, kind, p in self._listing() if e == cur and v <= target]
        anchors = [i for i, (_, kind, _) in enumerate(frames) if kind == "anchor"]
        cold = []
        if anchors:
            a = anchors[-1]
            cold = [frames[a][2]] + [
                p for v, kind, p in frames[a + 1 :] if kind == "delta" and v > frames[a][0]
            ]
        warm = None
        if epoch == cur and have is not None and any(v == have for v, _, _ in frames):
            by_version: dict[int, dict[str, Path]] = {}
            for v, kind, p in frames:
                if v > have:
                    by_version.setdefault(v, {})[kind] = p
            # one frame per version: the delta, else a wire anchor (a recovery anchor sits
            # beside its version's delta and is only for receivers that catch up)
            warm = [kinds.get("delta") or kinds["anchor"] for _, kinds in sorted(by_version.items())]
        if warm is not None and (not cold or _size(warm) <= _size(cold)):
            return warm
        return cold

    def next_frame(
        self, have_version: int | None, timeout: float | None = None, epoch: int | None = None
    ) -> bytes | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.before_read()
            plan = self.plan(have_version, epoch)
            if plan:
                t0 = time.monotonic()
                try:
                    data = plan[0].read_bytes()
                except FileNotFoundError:  # pruned between listing and reading: plan again
                    continue
                self.last_fetch_s = time.monotonic() - t0
                self.bytes_read += len(data)
                stem, _, kind = plan[0].name.partition(".")
                e, _, v = stem.partition("-")
                self.frames_read.append((int(e, 16), int(v), kind))
                return data
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)


def _size(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            return 1 << 62  # being pruned: not a path to take
    return total


class ModalVolumeStore(DirectoryStore):
    """A ``DirectoryStore`` on a mounted ``modal.Volume``: ``commit()`` after every write
    that others must see, ``reload()`` before every look. ``volume`` is the
    ``modal.Volume`` object (e.g. ``modal.Volume.from_name(name)``) mounted at ``root``."""

    def __init__(self, volume: Any, root: str | Path, **kwargs: Any) -> None:
        self.volume = volume
        super().__init__(root, **kwargs)

    def after_write(self) -> None:
        self.volume.commit()

    def before_read(self) -> None:
        self.volume.reload()
