"""Publishing a directory written on one host so that readers on other hosts see it.

The port is ``DirSync`` (``commit(path)`` after writing, ``reload(path)`` before reading), with
two implementations, chosen per path by ``sync_for``:

- ``LocalDirSync``: a POSIX directory (local disk, NFS). ``commit`` fsyncs every file and
  directory under ``path``; ``reload`` does nothing (POSIX readers see durable writes).
- ``ModalVolumeSync``: a mounted ``modal.Volume``. ``commit``/``reload`` are the Volume's own,
  which act on the whole mount. The Volume object is created lazily, only for a mapped path.

A path is on a Modal Volume iff it lies under a mount path named in ``MODAL_RL_VOLUMES``
(JSON ``{"<mount path>": "<volume name>"}``, set by the launcher on every container).

Above the port, one code path for both:

- ``publish(path)`` writes a commit marker ``<path>/.modal-rl-commit/<node>.json`` listing the
  files (and sizes) this node sees under ``path``, then commits. It runs at most once per
  distinct state of ``path`` per node: every co-located caller takes the same node-local file
  lock, and whoever finds the state already committed returns at once — after the commit, so
  no caller returns before the node's writes are published.
- ``await_visible(path, required)`` reloads until ``path`` holds at least one marker, every file
  a marker lists at its listed size, and every ``required`` file; else a ``TimeoutError`` that
  names what is missing. (It cannot know how many nodes wrote: a caller that reads before every
  writer published must name the other nodes' files in ``required``.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from modal_rl import wire_json
from modal_rl.retry import wait_for
from modal_rl.weightsync.errors import StoreFileError

log = logging.getLogger(__name__)

VOLUMES_ENV = "MODAL_RL_VOLUMES"
NODE_ID_ENV = "MODAL_RL_NODE_ID"  # defaults to the hostname (one Modal container = one host)
NODE_STATE_ENV = "MODAL_RL_NODE_STATE_DIR"  # node-local lock/state dir; default: <tmp>/modal-rl-publish-<uid>
MARKER_DIR = ".modal-rl-commit"
MAX_MARKER_BYTES = 64 << 20  # a marker lists one node's files: ~100 bytes each

_VOLUMES: dict[str, Any] = {}  # volume name -> modal.Volume, one object per process


class DirSync(Protocol):
    def commit(self, path: Path) -> None: ...

    def reload(self, path: Path) -> None: ...


class LocalDirSync:
    """Durability on a POSIX directory: fsync files, then the marker, then the directories."""

    def commit(self, path: Path) -> None:
        files, dirs = [], [path]
        for root, dirnames, filenames in os.walk(path):
            dirs += [Path(root, d) for d in dirnames]
            files += [Path(root, f) for f in filenames]
        # data before markers: a durable marker never points at bytes that are not
        files.sort(key=lambda p: MARKER_DIR in p.parts)
        for p in files + dirs:
            with contextlib.suppress(FileNotFoundError):  # removed by a concurrent writer
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def reload(self, path: Path) -> None:
        pass


class ModalVolumeSync:
    """A mounted ``modal.Volume`` (or anything with its ``commit()``/``reload()``)."""

    def __init__(self, volume: Any, mount: str) -> None:
        self.volume, self.mount = volume, mount

    def commit(self, path: Path) -> None:
        self.volume.commit()

    def reload(self, path: Path) -> None:
        self.volume.reload()


def volume_mounts() -> dict[str, str]:
    """``MODAL_RL_VOLUMES`` parsed and checked: {absolute mount path: volume name}."""
    raw = os.environ.get(VOLUMES_ENV, "").strip()
    if not raw:
        return {}
    try:
        mounts = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{VOLUMES_ENV} must be JSON {{mount_path: volume_name}}, got {raw[:80]!r}") from exc
    if not isinstance(mounts, dict) or not all(
        isinstance(k, str) and k.startswith("/") and isinstance(v, str) and v for k, v in mounts.items()
    ):
        raise ValueError(f"{VOLUMES_ENV} must map absolute mount paths to volume names, got {raw[:80]!r}")
    return {os.path.normpath(k): v for k, v in mounts.items()}


def _open_volume(name: str) -> Any:
    import modal  # only where a Modal Volume is mapped

    return modal.Volume.from_name(name)


def sync_for(path: str | Path) -> DirSync:
    """The sync for ``path``: the Modal Volume of the deepest mapped mount above it, else local."""
    path = os.path.normpath(os.path.abspath(path))
    best = max(
        (m for m in volume_mounts() if path == m or path.startswith(m.rstrip("/") + "/")),
        key=len,
        default=None,
    )
    if best is None:
        return LocalDirSync()
    name = volume_mounts()[best]
    if name not in _VOLUMES:
        _VOLUMES[name] = _open_volume(name)
    return ModalVolumeSync(_VOLUMES[name], best)


def node_id() -> str:
    return os.environ.get(NODE_ID_ENV) or socket.gethostname()


def _listing(path: Path) -> dict[str, tuple[int, int]]:
    """{relative file path: (size, mtime_ns)} under ``path``, markers excluded."""
    out = {}
    for root, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d != MARKER_DIR)
        for name in filenames:
            p = Path(root, name)
            with contextlib.suppress(FileNotFoundError):
                st = p.stat()
                out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns)
    return out


@contextlib.contextmanager
def _node_lock(key: str):
    from modal_rl.run_temp import private_dir

    # Per user, 0700, never another user's (``private_dir``): in a shared /tmp another user
    # could otherwise plant ``<key>.lock`` as a link and have us create or write through it.
    default = Path(tempfile.gettempdir(), f"modal-rl-publish-{os.getuid()}")
    state = private_dir(os.environ.get(NODE_STATE_ENV) or default)
    fd = os.open(state / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield state / f"{key}.committed"
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def open_regular(path: Path, max_bytes: int | None = None) -> tuple[int, os.stat_result]:
    """A read-only descriptor on ``path`` and its ``fstat``, or ``StoreFileError``: ``path``
    is a symbolic link (not followed), not a regular file (a FIFO opens without blocking and is
    refused), or larger than ``max_bytes``. ``FileNotFoundError`` passes through. The checks
    are on the opened file, so it cannot be swapped between the check and the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreFileError(f"{path} is a symbolic link; store files are never followed") from None
        raise
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif max_bytes is not None and st.st_size > max_bytes:
        why = f"is {st.st_size} bytes, over the {max_bytes} its format allows"
    if why is not None:
        os.close(fd)
        raise StoreFileError(f"{path} {why}; refused unread")
    return fd, st


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` (see ``open_regular``), at most ``max_bytes`` even if it grows."""
    fd, _ = open_regular(path, max_bytes)
    with open(fd, "rb", closefd=True) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise StoreFileError(f"{path} grew past the {max_bytes} bytes its format allows; refused")
    return data


def move_aside(path: Path) -> Path | None:
    """Whatever is at ``path`` that is not a regular file (a directory, a symbolic link, a
    fifo, a socket: a squatter ``os.replace`` cannot or must not overwrite) renamed to
    ``.<name>.squatter-<ns>`` beside it and logged; the new name, or None when there was none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    aside = path.with_name(f".{path.name}.squatter-{time.time_ns()}")
    os.rename(path, aside)  # a rename never follows a link and moves a directory whole
    log.warning(
        "store: %s was a %s, not a regular file: moved aside to %s", path, _kind(st.st_mode), aside.name
    )
    return aside


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "fifo")):
        if test(mode):
            return name
    return "special file"


def write_new(tmp: Path, chunks: Iterable[bytes]) -> int:
    """Write ``chunks`` to a fresh ``tmp`` (a stale one, or a link planted there, is removed,
    never followed; a directory or other squatter there is moved aside) and fsync it; the bytes
    written. The caller renames it into place (after ``move_aside`` of the target)."""
    move_aside(tmp)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    size = 0
    with open(fd, "wb", closefd=True) as f:
        for chunk in chunks:
            f.write(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return size


def _write_durable(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    write_new(tmp, [data])
    move_aside(path)
    os.replace(tmp, path)


def _write_local(path: Path, data: bytes) -> None:
    """Node-local bookkeeping (no fsync: losing it costs one more commit): a fresh file
    (``O_EXCL|O_NOFOLLOW``) renamed into place, so nothing is written through a link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def publish(path: str | Path, sync: DirSync | None = None) -> bool:
    """Commit what this node wrote under ``path`` (once per node per state); True if it committed.

    A ``path`` this node cannot see holds nothing it wrote (on a volume, another node's mkdir
    is invisible until a reload): nothing to publish, False."""
    path = Path(path)
    if not path.is_dir():
        return False
    sync = sync or sync_for(path)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    with _node_lock(key) as state_file:
        files = _listing(path)
        fingerprint = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
        with contextlib.suppress(FileNotFoundError):
            if state_file.read_text() == fingerprint:
                return False  # a co-located caller already committed exactly this state
        marker = {"node": node_id(), "time": time.time(), "files": {k: s for k, (s, _) in files.items()}}
        _write_durable(path / MARKER_DIR / f"{node_id()}.json", json.dumps(marker).encode())
        sync.commit(path)
        _write_local(state_file, fingerprint.encode())  # never through a link
        return True


def missing(path: Path, required: Iterable[str] = ()) -> list[str]:
    """What ``path`` still lacks to be complete, per its markers and ``required`` (empty: complete)."""
    if not path.is_dir():
        return [f"{path} (directory)"]
    markers = sorted((path / MARKER_DIR).glob("*.json")) if (path / MARKER_DIR).is_dir() else []
    if not markers:
        return [f"{path / MARKER_DIR}/<node>.json (no writer has committed)"]
    out = []
    for m in markers:
        try:
            listed = wire_json.loads(
                read_regular(m, MAX_MARKER_BYTES), max_bytes=MAX_MARKER_BYTES, max_depth=4
            )["files"]
            if not isinstance(listed, dict):
                raise ValueError("files is not a mapping")
        except (ValueError, KeyError, TypeError, OSError, StoreFileError):
            out.append(f"{m} (unreadable)")
            continue
        for rel, size in listed.items():
            p = path / rel
            if not p.is_file() or p.stat().st_size != size:
                out.append(f"{rel} ({size} bytes, listed by {m.stem})")
    out += [f"{rel} (required)" for rel in required if not (path / rel).is_file()]
    return out


def await_visible(
    path: str | Path,
    required: Callable[[], Iterable[str]] | Iterable[str] = (),
    *,
    timeout_s: float = 120.0,
    poll_s: float = 0.5,
    sync: DirSync | None = None,
) -> None:
    """Reload until ``path`` is complete (see ``missing``), or raise ``TimeoutError`` saying what is not.

    ``required`` may be a callable, re-evaluated after every reload (e.g. files an index names)."""
    path = Path(path)
    sync = sync or sync_for(path)
    lacking: list[str] = []

    def complete() -> bool:
        sync.reload(path)
        lacking[:] = missing(path, required() if callable(required) else required)
        return not lacking

    if not wait_for(complete, timeout_s, poll_s):
        shown = ", ".join(lacking[:5]) + (f" and {len(lacking) - 5} more" if len(lacking) > 5 else "")
        raise TimeoutError(f"{path} not complete after {timeout_s:g}s; missing: {shown}")
