"""A run's parts directory: where the processes of one run leave the numbers the trainer logs.

``MODAL_RL_RUN_PARTS_DIR`` (:data:`PARTS_ENV`), set by the launcher for every process of a
run, names it. Writers append or replace whole files, one per process, so no two processes
write one file: ``masks-<pid>.jsonl`` (one line per sample left out of the loss,
:func:`record_mask`), ``sandbox-reward-<pid>.json`` (a sandbox reward process's counters and
pool snapshot, rewritten atomically), ``engine-events.jsonl`` (engine supervisor events, by
the trainer's process). :class:`PartsReader`, in the trainer's process, reads what is new.

Invariants: a writer never raises (a number lost is better than a failed sample); the reader
only reads whole lines; a directory that is not set or does not exist reads as empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

PARTS_ENV = "MODAL_RL_RUN_PARTS_DIR"
EVENTS_FILE = "engine-events.jsonl"


def parts_dir() -> Path | None:
    value = os.environ.get(PARTS_ENV)
    return Path(value) if value else None


def record_mask(cause: str) -> None:
    """A sample left out of the loss (``cause``: ``engine``, or the reward's: ``sandbox``,
    ``bad_tests``, ``internal``); nothing without a parts directory."""
    parts = parts_dir()
    if parts is None:
        return
    with contextlib.suppress(OSError):
        parts.mkdir(parents=True, exist_ok=True)
        with open(parts / f"masks-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps({"t": time.time(), "cause": cause}) + "\n")


def record_events(parts: Path | None, events: list[dict]) -> None:
    if parts is None or not events:
        return
    with contextlib.suppress(OSError):
        parts.mkdir(parents=True, exist_ok=True)  # the first writer of a run makes it
    with contextlib.suppress(OSError), open(parts / EVENTS_FILE, "a") as f:
        f.writelines(json.dumps(e, default=str) + "\n" for e in events)


def record_sandbox(counts: dict[str, int], pool_snapshot: dict) -> None:
    """This reward process's counters (``samples``, ``execs``, ``sandbox_errors``) and its
    pool's snapshot, as ``sandbox-reward-<pid>.json`` (replaced whole); nothing without a
    parts directory."""
    parts = parts_dir()
    if parts is None:
        return
    with contextlib.suppress(OSError):
        parts.mkdir(parents=True, exist_ok=True)
        path = parts / f"sandbox-reward-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**counts, "pid": os.getpid(), "pool": pool_snapshot}, default=str))
        tmp.replace(path)


class PartsReader:
    """What the run's other processes wrote since the last read."""

    def __init__(self, parts: Path | None):
        self.parts = parts
        self._pos: dict[str, int] = {}

    def _files(self, pattern: str) -> list[Path]:
        if self.parts is None or not self.parts.is_dir():
            return []
        return sorted(self.parts.glob(pattern))

    def new_masks(self) -> list[str]:
        """The causes of the samples masked since the last call."""
        causes = []
        for path in self._files("masks-*.jsonl"):
            chunk = b""
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(self._pos.get(path.name, 0))
                chunk = f.read()
            cut = chunk.rfind(b"\n") + 1
            self._pos[path.name] = self._pos.get(path.name, 0) + cut
            for line in chunk[:cut].splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    causes.append(str(json.loads(line).get("cause")))
        return causes

    def sandbox_snapshots(self) -> dict[str, dict]:
        """Each sandbox reward process's latest snapshot, by file name."""
        now = {}
        for path in self._files("sandbox-reward-*.json"):
            with contextlib.suppress(OSError, ValueError):
                now[path.name] = json.loads(path.read_text())
        return now
