"""Host-wide registry of local sandboxes, so an orphan sweep can find them after a crash.

One JSON file per live sandbox in ``registry_dir`` holding its process group, the start time
of its leader (to never signal a recycled PID) and its tags. Files are removed on terminate;
a sweep removes stale ones.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import psutil

DEFAULT_DIR = Path(os.environ.get("MODAL_RL_SANDBOX_REGISTRY", "/tmp/modal-rl-sandboxes"))


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
    registry_dir.mkdir(parents=True, exist_ok=True)
    path = registry_dir / f"{sandbox_id}.json"
    entry = {"id": sandbox_id, "pid": pid, "pgid": pid, "starttime": proc_starttime(pid), "tags": dict(tags)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    tmp.replace(path)  # atomic: a concurrent sweep never reads half an entry
    return path


def unregister(registry_dir: Path, sandbox_id: str) -> None:
    (registry_dir / f"{sandbox_id}.json").unlink(missing_ok=True)


def entries(registry_dir: Path) -> list[dict]:
    out = []
    for path in sorted(registry_dir.glob("*.json")) if registry_dir.is_dir() else []:
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # removed or being written concurrently
    return out


def sweep(registry_dir: Path, tags: Mapping[str, str]) -> int:
    """SIGKILL the process group of every registered sandbox whose tags include ``tags``.

    Returns the number of live sandboxes killed. Entries whose leader is gone (or was
    replaced by another process with the same PID) are only removed.
    """
    if not tags:
        raise ValueError("sweep needs at least one tag (key=value); refusing to kill every sandbox")
    killed = 0
    for entry in entries(registry_dir):
        if any(entry.get("tags", {}).get(k) != v for k, v in tags.items()):
            continue
        pid = int(entry["pid"])
        if entry.get("starttime") is not None and proc_starttime(pid) == entry["starttime"]:
            try:
                os.killpg(int(entry["pgid"]), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        unregister(registry_dir, entry["id"])
    return killed
