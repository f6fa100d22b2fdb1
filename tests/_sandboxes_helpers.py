"""Shared helpers for the sandbox tests (imported, not a conftest)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(root: int) -> set[int]:
    """PIDs of every live process below ``root`` (host view)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out and alive(child):
                out.add(child)
                todo.append(child)
    return out


def wait_gone(pids, timeout: float = 5.0) -> set[int]:
    """Wait until none of ``pids`` is alive; returns the survivors."""
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = {p for p in left if alive(p)}
    return left


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def sandbox_processes() -> set[int]:
    """Live bwrap processes below this test process, and everything below them.

    (Other descendants, e.g. multiprocessing's resource tracker, are not sandboxes.)"""
    out = set()
    for pid in descendants(os.getpid()):
        if _comm(pid) == "bwrap":
            out |= {pid} | descendants(pid)
    return out


def no_processes_left(timeout: float = 5.0) -> None:
    """Assert no sandbox process of this test process is alive."""
    left = wait_gone(sandbox_processes(), timeout)
    assert not left, f"sandbox processes left behind: {sorted(left)}"
