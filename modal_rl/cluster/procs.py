"""Finding and ending exactly the processes one cluster run started.

Every node process we launch carries ``MODAL_RL_RUN_ID=<uuid>`` in its environment, and
every process Ray starts beneath it (GCS, raylet, dashboard, workers, job drivers) inherits
it, even after it is re-parented to init. So "processes of this run" is an exact, lineage-
independent set read from each process's environment (``psutil``); teardown ends that set and
nothing else (never ``ray stop`` or a kill by name, which would hit other users' clusters on
the host).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from modal_rl.retry import wait_for

RUN_ID_ENV = "MODAL_RL_RUN_ID"
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def _live(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


def pids_of_run(run_id: str) -> list[int]:
    """Live PIDs whose environment holds ``MODAL_RL_RUN_ID=run_id`` (zombies excluded)."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(RUN_ID_ENV) != run_id:
                continue
        except _GONE:
            continue  # gone, a zombie, or another user's process (not ours to end)
        if _live(proc):
            found.append(proc.pid)
    return sorted(found)


def children_of(pid: int) -> list[int]:
    """Direct and indirect children of ``pid`` at this moment."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except _GONE:
        return []


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (a zombie has exited: it does not count)."""
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
        except _GONE:
            continue
        if _live(proc):
            out.append(pid)
    return out


def end_run(run_id: str, grace_s: float = 3.0) -> list[int]:
    """SIGTERM every process of the run, SIGKILL what is left after ``grace_s``; returns survivors.

    Repeats the scan, because Ray may fork a worker between our scan and our signal.
    """
    pids = pids_of_run(run_id)
    signal_pids(pids, signal.SIGTERM)
    wait_for(lambda: not alive(pids), grace_s, poll_s=0.1)
    for _ in range(5):
        pids = pids_of_run(run_id)
        if not pids:
            return []
        signal_pids(pids, signal.SIGKILL)
        time.sleep(0.2)
    return pids_of_run(run_id)


def remember_start(proc) -> None:
    """Note ``proc``'s start time (``run_temp.owner_token``) right after it was started, for
    ``signal_group``."""
    from modal_rl import run_temp

    proc.modal_rl_token = run_temp.owner_token(proc.pid)


def signal_group(proc, sig: int) -> bool:
    """Send ``sig`` to the process group ``proc`` leads, only while its leader is still the
    process we started: not reaped (``returncode`` unset) and with the start time noted by
    ``remember_start``. Once reaped, its pid — and the group number — may be another user's
    or program's (pid reuse): then nothing is sent and False is returned (the run's other
    processes are found by their run tag instead, ``end_run``)."""
    from modal_rl import run_temp

    token = getattr(proc, "modal_rl_token", None)
    if proc.returncode is not None or token is None or run_temp.owner_token(proc.pid) != token:
        return False
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
