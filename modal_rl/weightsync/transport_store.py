"""Store transport: publish/subscribe through a directory, or a Modal Volume.

Layout under ``root``:

    frames/<version:012d>.<anchor|delta>   one frame per version
    latest                                 JSON {"version", "kind", "anchor"}

Invariants:
- a frame file appears under its final name only when complete (written to a temporary
  name, fsynced, renamed), and ``latest`` is advanced only after the frame is durable —
  for a Modal Volume, after ``commit()`` returned — so a reader never sees a pointer to
  bytes that are not there;
- readers ``reload()`` before looking, and follow ``latest``: deltas after their version
  if retained, else the newest anchor at or below ``latest`` and the deltas after it;
- frames older than the ``keep_anchors``-th newest anchor are pruned after the pointer moves;
- with a key (the default: the run's key from the environment) every frame is written
  signed, and a ``Subscriber`` reading the store accepts only frames whose every record's
  MAC matches that key — a file altered on the disk or volume, even with its checksums
  recomputed, is refused; ``key=None`` is the explicit keyless mode.
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

POLL_S = 0.05


class DirectoryStore:
    """FrameSink and FrameSource over a directory (local disk, NFS, or a mounted volume)."""

    def __init__(self, root: str | Path, *, key=FROM_ENV, keep_anchors: int = 1) -> None:
        if keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1")
        self.keys = frame_keys(key)
        self.root = Path(root)
        self.frames_dir = self.root / "frames"
        self.frames_dir.mkdir(parents=True, exist_ok=True)
        self.keep_anchors = keep_anchors
        self.last_fetch_s = 0.0

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

    def frame_path(self, version: int, kind: str) -> Path:
        return self.frames_dir / f"{version:012d}.{kind}"

    def send(self, header: VersionHeader, records: Iterable[bytes]) -> int:
        path = self.frame_path(header.version, header.kind)
        size = self._write_atomic(path, sign_records(records, self.keys))
        self.after_write()  # the frame is durable before anything points at it
        anchor = header.version if header.kind == "anchor" else self.latest().get("anchor")
        pointer = {"version": header.version, "kind": header.kind, "anchor": anchor}
        self._write_atomic(self.root / "latest", [json.dumps(pointer).encode()])
        self.after_write()
        self._prune()
        return size

    def _listing(self) -> list[tuple[int, str, Path]]:
        out = []
        for path in self.frames_dir.iterdir():
            stem, _, kind = path.name.partition(".")
            if stem.isdigit() and kind in ("anchor", "delta"):
                out.append((int(stem), kind, path))
        return sorted(out)

    def _prune(self) -> None:
        anchors = [v for v, kind, _ in self._listing() if kind == "anchor"]
        if len(anchors) > self.keep_anchors:
            oldest_kept = anchors[-self.keep_anchors]
            for v, _, path in self._listing():
                if v < oldest_kept:
                    path.unlink(missing_ok=True)
            self.after_write()

    def latest(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / "latest").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def plan(self, have: int | None) -> list[Path]:
        """The frame files that bring a receiver at ``have`` to ``latest``."""
        latest = self.latest().get("version")
        if latest is None or (have is not None and have >= latest):
            return []
        listing = [(v, kind, p) for v, kind, p in self._listing() if v <= latest]
        versions = [v for v, _, _ in listing]
        if have is not None and have in versions:
            return [p for v, _, p in listing if v > have]
        anchors = [i for i, (_, kind, _) in enumerate(listing) if kind == "anchor"]
        return [p for _, _, p in listing[anchors[-1] :]] if anchors else []

    def next_frame(self, have_version: int | None, timeout: float | None = None) -> bytes | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.before_read()
            plan = self.plan(have_version)
            if plan:
                t0 = time.monotonic()
                try:
                    data = plan[0].read_bytes()
                except FileNotFoundError:  # pruned between listing and reading: plan again
                    continue
                self.last_fetch_s = time.monotonic() - t0
                return data
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def close(self) -> None:
        pass


class ModalVolumeStore(DirectoryStore):
    """A ``DirectoryStore`` on a mounted ``modal.Volume``: ``commit()`` after every write
    that others must see, ``reload()`` before every look. ``volume`` is the
    ``modal.Volume`` object (e.g. ``modal.Volume.from_name(name)``) mounted at ``root``."""

    def __init__(self, volume: Any, root: str | Path, *, key=FROM_ENV, keep_anchors: int = 1) -> None:
        super().__init__(root, key=key, keep_anchors=keep_anchors)
        self.volume = volume

    def after_write(self) -> None:
        self.volume.commit()

    def before_read(self) -> None:
        self.volume.reload()
