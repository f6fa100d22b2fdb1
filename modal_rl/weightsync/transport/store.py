"""Store transport: publish/subscribe through a directory, or a Modal Volume.

Layout under ``root``:

    frames/<epoch:016x>-<version:012d>.<anchor|delta>   one frame per version (and kind)
    latest                                              JSON {"run", "epoch", "version", "kind", "anchor", "at", "sig"}
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
  current one and the previous one, which a receiver may still be reading) of the frames
  *this publisher wrote*, in ``(epoch, version)`` order; older ones are deleted after the
  pointer moved. Nothing unsigned decides anything: a file's name (anyone's to choose) never
  decides what is pruned nor the epoch a trainer takes (that comes from ``latest`` and the
  lease record, both signed); a previous trainer's frames are left for its operator to delete;
- a squatter at a name the publisher writes (``latest``, ``lease``, a frame, their temporary
  names) — a directory, link, fifo or socket — is moved aside (``volumes.move_aside``) and
  logged, never a stop;
- with a key (the default: the run's key from the environment) every frame, the lease and
  ``latest`` are written signed by the trainer (Ed25519: a frame once, in its end record;
  ``latest`` over its version, epoch, kind, anchor and write time ``at``), and a reader
  accepts only a pointer and frames whose MACs and signature match — a file altered on the
  disk or volume, even with its checksums recomputed, or written by a reader, is refused; ``key=None`` is the
  explicit keyless mode (nothing signed, nothing to trust);
- a reader trusts no file of the store: it never follows a symbolic link, refuses anything
  but a regular file, reads a frame record by record — each record's length checked against
  the cap for its tag (a chunk's from its group header) and against the bytes the file has,
  each record verified (MAC) before the next is read — refuses bytes after the end record,
  and refuses a frame whose verified header is not the version its name says. So a planted
  file costs at most one capped record and is a typed, logged refusal (once per file: the
  reader then waits for the store to change), never a ``MemoryError`` or a hang;
- a reader given a ``floor`` (``(epoch or None, version)``, e.g. from a signed pull) refuses
  a ``latest`` below it (``RolledBackError``); a reader of an epoch never goes back within it
  or to an older one. A cold reader without a floor cannot tell a replayed old ``latest`` (with
  the old frames it names) from a run at that version (docs/weight-sync.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from modal_rl.weightsync.catchup import CannotCatchUp, Held, Retained, catch_up
from modal_rl.weightsync.errors import RolledBackError, StoreFileError, WeightSyncError
from modal_rl.weightsync.transport.base import FrameSink, FrameSource
from modal_rl.weightsync.transport.lease import POINTER_FILE, StoreLease, read_pointer, signed_pointer
from modal_rl.weightsync.transport.volumes import move_aside, write_new
from modal_rl.weightsync.wire.auth import FROM_ENV, frame_keys, sign_records
from modal_rl.weightsync.wire.frame_file import read_frame_file
from modal_rl.weightsync.wire.frames import VersionHeader

log = logging.getLogger(__name__)
POLL_S = 0.05


class DirectoryStore(FrameSink, FrameSource):
    """FrameSink and FrameSource over a directory (local disk, NFS, or a mounted volume).

    ``lease_ttl_s``: how long a publisher's lease lives without a heartbeat;
    ``lease_wait_s``: how long a new publisher waits for a live lease to lapse before it is
    refused (default: the ttl, so a trainer restarted on another host takes over once the
    dead one's lease lapsed)."""

    recovery_anchors = True

    def __init__(
        self,
        root: str | Path,
        *,
        key=FROM_ENV,
        keep_anchors: int = 2,
        lease_ttl_s: float = 30.0,
        lease_wait_s: float | None = None,
        heartbeat: bool = True,
        max_frame_bytes: int | None = None,
    ) -> None:
        if keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1")
        self.keys = frame_keys(key)
        self.max_frame_bytes = max_frame_bytes  # a larger frame file is refused unread
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
        self._pointer: dict[str, Any] = {}  # the last ``latest`` this store's publisher wrote
        self._refused: set[tuple] = set()  # identities of files this reader refused
        self.squatters: list[Path] = []  # what this publisher moved aside (``volumes.move_aside``)
        # The frames this publisher wrote, (epoch, version, kind, path): the only ones it prunes
        # (a file's name is anyone's to choose, so names never decide what is deleted).
        self._written: list[tuple[int, int, str, Path]] = []

    # Hooks a networked store overrides (see ModalVolumeStore).
    def after_write(self) -> None:
        """Make everything written so far durable for other readers."""

    def before_read(self) -> None:
        """See everything other writers made durable."""

    def _write_atomic(self, path: Path, chunks: Iterable[bytes]) -> int:
        tmp = path.with_name(f".{path.name}.partial")
        # A directory, link or fifo squatting either name: moved aside and reported, not a stop.
        self.squatters += [p for p in (move_aside(tmp),) if p is not None]
        size = write_new(tmp, chunks)  # a link planted at the temporary name is not followed
        self.squatters += [p for p in (move_aside(path),) if p is not None]
        os.replace(tmp, path)
        return size

    def frame_path(self, epoch: int, version: int, kind: str) -> Path:
        return self.frames_dir / f"{epoch:016x}-{version:012d}.{kind}"

    # -- publisher side ----------------------------------------------------------------
    def open_epoch(self, run: str, epoch: int) -> int:
        """Take the lease (``LeaseHeldError`` while another publisher's is live); the epoch to
        publish, above every epoch this store has seen."""
        try:
            pointer = self.latest()
        except (WeightSyncError, OSError):  # unsigned (an older store) or damaged: ours replaces it
            pointer = {}
        # Epochs only from signed records (``latest`` here, the lease record in ``acquire``),
        # never from file names: a planted ``ffff...`` name would otherwise decide our epoch.
        after = pointer.get("epoch") if pointer else None
        self.epoch = self.lease.acquire(run, epoch, wait_s=self.lease_wait_s, after_epoch=after)
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
        self._written.append((header.epoch, header.version, header.kind, path))
        self.after_write()  # the frame is durable before anything points at it
        self.lease.renew(write=False)  # lost meanwhile: the pointer does not move to our frame
        # The anchor field comes from our own last pointer, not the store's (anyone's to write).
        anchor = header.version if header.kind == "anchor" else self._pointer.get("anchor")
        pointer = {"run": header.run, "epoch": header.epoch, "version": header.version}
        self._write_pointer(pointer | {"kind": header.kind, "anchor": anchor})
        self._prune()
        return size

    def _write_pointer(self, pointer: dict[str, Any]) -> None:
        """Sign and write ``latest`` (with the time it was written), then make it durable."""
        signed = signed_pointer(self.keys, pointer)
        self._write_atomic(self.root / POINTER_FILE, [json.dumps(signed).encode()])
        self.after_write()
        self._pointer = signed

    def send_recovery(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        """A recovery anchor of a version already published (see ``Publisher``): written
        beside its delta; the pointer's ``anchor`` moves to it; live readers never need it."""
        self._check_epoch(header)
        path = self.frame_path(header.epoch, header.version, "anchor")
        size = self._write_atomic(path, sign_records(records, self.keys))
        self._written.append((header.epoch, header.version, "anchor", path))
        self.after_write()
        mine = {k: v for k, v in self._pointer.items() if k not in ("at", "sig")}
        if mine.get("epoch") == header.epoch and mine.get("version") == header.version:
            self._write_pointer(mine | {"anchor": header.version})
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
        """Delete what this publisher wrote before its ``keep_anchors``-th newest anchor; files
        it did not write (another trainer's, or planted under any name) are never touched."""
        written = sorted(set(self._written), key=lambda e: (e[0], e[1], e[2] == "anchor"))
        anchors = [(e, v) for e, v, kind, _ in written if kind == "anchor"]
        if len(anchors) > self.keep_anchors:
            oldest_kept = anchors[-self.keep_anchors]
            for e, v, _, path in written:
                if (e, v) < oldest_kept:
                    path.unlink(missing_ok=True)
            self._written = [w for w in written if (w[0], w[1]) >= oldest_kept]
            self.after_write()

    def close(self) -> None:
        """Release the lease if this store published (readers hold none)."""
        self.lease.release()

    # -- subscriber side ---------------------------------------------------------------
    def latest(self) -> dict[str, Any]:
        """The store's ``latest`` pointer, verified ({} before anything was published), or a
        typed one-line refusal (``lease.read_pointer``)."""
        return read_pointer(self.root / POINTER_FILE, self.keys)

    def _current(self, floor: tuple[int | None, int] | None) -> dict[str, Any]:
        latest = self.latest()
        if latest and floor is not None and _below((latest["epoch"], latest["version"]), floor):
            fe, fv = floor
            raise RolledBackError(
                f"{self.root / POINTER_FILE} names v{latest['version']} of epoch {latest['epoch']:x}, older than "
                f"this receiver's floor v{fv}"
                + (f" of epoch {fe:x}" if fe is not None else "")
                + ": a rolled-back or stale store; refused"
            )
        return latest

    def _checked(self, path: Path, read: Callable[[], Any], default: Any) -> Any:
        """``read()``; a refusal is logged and remembered by the file's identity, so the same
        file is refused once and then waited out (``default``) until it changes."""
        ident = _ident(path)
        if ident is not None and ident in self._refused:
            return default
        try:
            return read()
        except WeightSyncError as exc:
            if ident is not None:
                if len(self._refused) > 4096:
                    self._refused.clear()
                self._refused.add(ident)
            log.warning("store file refused: %s", exc)
            raise

    def plan(
        self, have: int | None, epoch: int | None = None, floor: tuple[int | None, int] | None = None
    ) -> list[Path]:
        """The frame files that bring a receiver at ``(epoch, have)`` to ``latest``, by the
        catch-up rule (``weightsync.catchup``) over ``latest``'s epoch up to its version,
        weighing files by their size. File names carry no base version, so each delta is taken
        to follow the usable version listed before it (the chain refuses one that does not).
        Files this reader refused are not candidates: a planted name cannot hide the real
        anchor below it. Raises (once per pointer file) when ``latest`` is refused or below
        ``floor``."""
        latest = self._checked(self.root / POINTER_FILE, lambda: self._current(floor), {})
        target, cur = latest.get("version"), latest.get("epoch")
        if target is None or cur is None:
            return []
        if have is not None and epoch is not None and (epoch, have) >= (cur, target):
            return []  # the rule sends nothing here; said before listing, as a waiting reader polls
        paths = [
            (v, kind, p)
            for e, v, kind, p in self._listing()
            if e == cur and v <= target and (not self._refused or _ident(p) not in self._refused)
        ]
        deltas = {v for v, kind, _ in paths if kind == "delta"}
        views, before = [], None
        for v, kind, p in paths:  # an anchor beside its version's delta is a recovery anchor
            base = before if kind == "delta" else None
            views.append(Retained(kind, v, cur, base, _size(p), kind == "anchor" and v in deltas))
            before = v
        plan = catch_up(None if have is None else Held(have, epoch), views)
        return [] if isinstance(plan, CannotCatchUp) else [paths[i][2] for i in plan]

    def read_frame(self, path: Path) -> tuple[bytes, VersionHeader]:
        """The frame in ``path`` and its header, checked (``read_frame_file``) and named right."""
        data, header = read_frame_file(path, self.keys, self.max_frame_bytes)
        stem, _, kind = path.name.partition(".")
        e, _, v = stem.partition("-")
        if (header.epoch, header.version, header.kind) != (int(e, 16), int(v), kind):
            raise StoreFileError(
                f"{path} holds the {header.kind} of v{header.version} of epoch {header.epoch:x}, not the "
                "version its name says: renamed or planted; refused"
            )
        return data, header

    def next_frame(
        self,
        have_version: int | None,
        timeout: float | None = None,
        epoch: int | None = None,
        floor: tuple[int | None, int] | None = None,
    ) -> bytes | None:
        """The next frame for a receiver at ``(epoch, have_version)`` (None: nothing new in
        ``timeout``). Raises a ``WeightSyncError`` once for each refused file (see ``plan``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.before_read()
            plan = self.plan(have_version, epoch, floor)
            if plan:
                t0 = time.monotonic()
                try:
                    read = self._checked(plan[0], partial(self.read_frame, plan[0]), None)
                except FileNotFoundError:  # pruned between listing and reading: plan again
                    continue
                if read is not None:
                    data, header = read
                    self.last_fetch_s = time.monotonic() - t0
                    self.bytes_read += len(data)
                    self.frames_read.append((header.epoch, header.version, header.kind))
                    return data
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)


def _below(position: tuple[int, int], floor: tuple[int | None, int]) -> bool:
    """Whether ``position`` = (epoch, version) is under ``floor`` (without an epoch: by version)."""
    fe, fv = floor
    return position[1] < fv if fe is None else position < (fe, fv)


def _ident(path: Path) -> tuple | None:
    """What tells one file under ``path`` from another (a link is itself, never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 1 << 62  # being pruned: not a path to take


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
