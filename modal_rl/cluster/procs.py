"""Finding and ending exactly the processes one cluster run started.

Every node process we launch carries ``MODAL_RL_RUN_ID=<uuid>`` in its environment, and
every process Ray starts beneath it (GCS, raylet, dashboard, workers, job drivers) inherits
it, even after it is re-parented to init. So "processes of this run" is an exact, lineage-
independent set read from ``/proc/<pid>/environ``; teardown ends that set and nothing else
(never ``ray stop`` or a kill by name, which would hit other users' clusters on the host).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

RUN_ID_ENV = "MODAL_RL_RUN_ID"


def pids_of_run(run_id: str) -> list[int]:
    """Live PIDs whose environment holds ``MODAL_RL_RUN_ID=run_id`` (zombies excluded)."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def children_of(pid: int) -> list[int]:
    """Direct and indirect children of ``pid`` at this moment (walks PPid in /proc)."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        parent_of[int(entry.name)] = ppid
    out, frontier = [], [pid]
    while frontier:
        nxt = [c for c, p in parent_of.items() if p in frontier]
        out += nxt
        frontier = nxt
    return out


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            out.append(pid)
    return out


def end_run(run_id: str, grace_s: float = 3.0) -> list[int]:
    """SIGTERM every process of the run, SIGKILL what is left after ``grace_s``; returns survivors.

    Repeats the scan, because Ray may fork a worker between our scan and our signal.
    """
    deadline = time.monotonic() + grace_s
    pids = pids_of_run(run_id)
    signal_pids(pids, signal.SIGTERM)
    while time.monotonic() < deadline and alive(pids):
        time.sleep(0.1)
    for _ in range(5):
        pids = pids_of_run(run_id)
        if not pids:
            return []
        signal_pids(pids, signal.SIGKILL)
        time.sleep(0.2)
    return pids_of_run(run_id)
