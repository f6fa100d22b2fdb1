"""Live records of local sandboxes, so an orphan sweep can find them after a crash.

One JSON file per live sandbox in ``registry_dir`` holding its process group, the start time
of its leader (to never signal a recycled PID) and its tags. Files are removed on terminate;
a sweep removes stale ones.

Invariants (a sweep SIGKILLs whole process groups, so it must only ever reach our own):
- the default dir is per user, ``/tmp/modal-rl-sandboxes-<uid>`` (``MODAL_RL_SANDBOX_REGISTRY``
  overrides it): one shared dir would let any user plant an entry for another's sweep;
- a registry dir is made mode 0700 and, on every use (register, entries, sweep, the create
  rate limiter's file), refused with :class:`RegistryRefusedError` unless it is a directory
  owned by this user that group and others cannot write (a symlink must be ours too);
- an entry's process group is killed only if it belongs to its pid: ``pgid == pid``, the live
  process is that group's leader (``os.getpgid(pid) == pgid``) and its start time is the one
  recorded. A sandbox's bwrap is always started in a session of its own, so a real entry
  always passes; anything else is refused (never signalled), reported and removed. An entry
  whose process is gone is only removed (the normal trace of a crashed pool).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from modal_rl.sandboxes.errors import ProviderUnavailableError

ENV = "MODAL_RL_SANDBOX_REGISTRY"
log = logging.getLogger(__name__)


def default_dir() -> Path:
    """This user's registry: ``$MODAL_RL_SANDBOX_REGISTRY`` or ``/tmp/modal-rl-sandboxes-<uid>``.

    ``/tmp`` rather than ``$TMPDIR``: a sweep run from another shell must find the same dir."""
    return Path(os.environ.get(ENV) or f"/tmp/modal-rl-sandboxes-{os.geteuid()}")


DEFAULT_DIR = default_dir()


class RegistryRefusedError(ProviderUnavailableError):
    """The registry dir is not private to this user; its entries cannot be trusted."""


@dataclass
class RefusedEntry:
    """A registry entry a sweep would not act on, and why."""

    id: str
    reason: str


@dataclass
class SweepResult:
    killed: int = 0
    refused: list[RefusedEntry] = field(default_factory=list)


def _refuse(path: Path, why: str, fix: str) -> RegistryRefusedError:
    return RegistryRefusedError(
        f"sandbox registry {path} {why}; {fix} (or set {ENV} to a directory only you can write)"
    )


def check_dir(registry_dir: Path | str) -> Path:
    """``registry_dir`` if it is a directory owned by this user that nobody else can write;
    raises :class:`RegistryRefusedError` otherwise (a missing dir is not checked here)."""
    path = Path(registry_dir)
    me = os.geteuid()
    try:
        link, st = os.lstat(path), os.stat(path)
    except OSError as exc:  # e.g. a dangling symlink
        raise _refuse(path, f"cannot be checked ({exc.strerror})", "remove it") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        raise _refuse(path, f"is a symlink owned by uid {link.st_uid}, not you (uid {me})", "remove it")
    if st.st_uid != me:
        raise _refuse(path, f"is owned by uid {st.st_uid}, not you (uid {me})", "remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory", "remove it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = f"{stat.S_IMODE(st.st_mode):o}"
        raise _refuse(path, f"is writable by group or others (mode {mode})", f"run chmod 700 {path}")
    return path


def open_dir(registry_dir: Path | str) -> Path:
    """Make ``registry_dir`` (mode 0700, parents as usual) if missing, then :func:`check_dir` it."""
    path = Path(registry_dir)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)  # umask can only take bits away from 0700
    return check_dir(path)


def proc_starttime(pid: int) -> float | None:
    """When ``pid`` started (``psutil``'s create time, fixed for a process's life), so a
    recycled PID is never mistaken for the sandbox; None if it is gone or a zombie."""
    try:
        proc = psutil.Process(pid)
        # a zombie is already dead
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def register(registry_dir: Path, sandbox_id: str, pid: int, tags: Mapping[str, str]) -> Path:
    """Record ``pid``, which must lead its own process group (it is what a sweep kills)."""
    path = open_dir(registry_dir) / f"{sandbox_id}.json"
    entry = {"id": sandbox_id, "pid": pid, "pgid": pid, "starttime": proc_starttime(pid), "tags": dict(tags)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    tmp.replace(path)  # atomic: a concurrent sweep never reads half an entry
    return path


def unregister(registry_dir: Path, sandbox_id: str) -> None:
    (Path(registry_dir) / f"{sandbox_id}.json").unlink(missing_ok=True)


def _read(registry_dir: Path) -> list[tuple[Path, dict]]:
    registry_dir = Path(registry_dir)
    if not registry_dir.exists():
        return []
    check_dir(registry_dir)
    out = []
    for path in sorted(registry_dir.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed concurrently
        if isinstance(entry, dict):
            out.append((path, entry))
    return out


def entries(registry_dir: Path) -> list[dict]:
    """Every entry (a dict) in ``registry_dir``; [] if it does not exist. Refuses a dir that
    is not private (:func:`check_dir`): its entries could be anyone's."""
    return [entry for _, entry in _read(registry_dir)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _verdict(entry: dict) -> str | None:
    """None if the entry's process group may be killed, "gone" if its process is gone, else
    why it is refused."""
    pid, pgid, start = entry.get("pid"), entry.get("pgid"), entry.get("starttime")
    if not (_is_int(pid) and _is_int(pgid) and pid > 1 and isinstance(start, int | float)):
        return f"malformed entry (pid={pid!r}, pgid={pgid!r}, starttime={start!r})"
    if pgid != pid:
        return f"pgid {pgid} is not its pid {pid}: a sandbox always leads its own process group"
    now = proc_starttime(pid)
    if now is None:
        return "gone"
    if now != start:
        return f"pid {pid} is another process now (start time {now} != {start})"
    try:
        actual = os.getpgid(pid)
    except ProcessLookupError:
        return "gone"
    if actual != pgid:
        return f"pid {pid} is in process group {actual}, not {pgid}: it leads no group of its own"
    return None


def sweep_report(registry_dir: Path, tags: Mapping[str, str]) -> SweepResult:
    """SIGKILL the process group of every registered sandbox whose tags include ``tags``.

    Returns how many were killed and the entries refused (module invariants); every matching
    entry is removed either way. Entries of other tags are not looked at.
    """
    if not tags:
        raise ValueError("sweep needs at least one tag (key=value); refusing to kill every sandbox")
    result = SweepResult()
    for path, entry in _read(registry_dir):
        etags = entry.get("tags")
        if not isinstance(etags, dict) or any(etags.get(k) != v for k, v in tags.items()):
            continue
        verdict = _verdict(entry)
        if verdict is None:
            try:
                os.killpg(entry["pgid"], signal.SIGKILL)
                result.killed += 1
            except ProcessLookupError:
                pass
        elif verdict != "gone":
            result.refused.append(RefusedEntry(path.stem, verdict))
        path.unlink(missing_ok=True)  # by its own path: an entry's "id" field is only data
    return result


def sweep(registry_dir: Path, tags: Mapping[str, str]) -> int:
    """:func:`sweep_report`, returning the number killed and logging each refused entry."""
    result = sweep_report(registry_dir, tags)
    for refused in result.refused:
        log.warning("sandbox registry %s: refused entry %s: %s", registry_dir, refused.id, refused.reason)
    return result.killed
