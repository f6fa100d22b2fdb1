"""Progress on long work: a bar (``tqdm``) over counted work and a line per phase with its
elapsed time on a terminal; on anything else (CI logs, pipes, files) only what keeps long work
from going silent: a line every ``HEARTBEAT_S`` while a phase or a loop runs (no bar frames,
and nothing for work shorter than that, so a one-line error stays one line).

    for case in bar(cases, desc="weight-sync cases"): ...
    with phase("making the tiny model"): ...    # "making the tiny model ... done in 3.2 s"

``MODAL_RL_PROGRESS=1`` forces bars on a non-terminal, ``=0`` turns progress off everywhere.

Invariants: progress goes to stderr (default), so stdout keeps only the results; never changes
what the wrapped work yields or raises; a phase that raises prints ``failed after`` with its
time, then the exception propagates; no stretch of progress-wrapped work is silent for more
than ``HEARTBEAT_S`` (a phase still running says so; off a terminal a count line comes at
least that often); tqdm is optional (count lines without it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

ENV = "MODAL_RL_PROGRESS"
HEARTBEAT_S = 14.0  # the longest progress-wrapped work stays silent


def quiet() -> bool:
    """``MODAL_RL_PROGRESS=0``: no progress at all."""
    return os.environ.get(ENV) == "0"


def shown(stream: TextIO | None = None) -> bool:
    """Whether progress goes to ``stream`` (default stderr): a terminal, unless ``ENV`` says."""
    forced = os.environ.get(ENV)
    if forced in ("0", "1"):
        return forced == "1"
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False


def bar(iterable: Iterable, total: int | None = None, desc: str = "", stream: TextIO | None = None):
    """``iterable`` with a tqdm bar on ``stream`` (stderr) when :func:`shown`, else with a count
    line at most every ``HEARTBEAT_S`` and one at the end (nothing when :func:`quiet`)."""
    stream = sys.stderr if stream is None else stream
    if quiet():
        return iterable
    if shown(stream):
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, file=stream)
    return _counted(iterable, total, desc, stream)


def _counted(iterable: Iterable, total: int | None, desc: str, stream: TextIO) -> Iterator:
    """Count lines: one at most every ``HEARTBEAT_S``, and a closing one if any was printed."""
    t0 = last = time.monotonic()
    done, spoke = 0, False
    of = f"/{total}" if total is not None else ""
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= HEARTBEAT_S:
            stream.write(f"{desc}: {done}{of} after {_elapsed(now - t0)}\n")
            stream.flush()
            last, spoke = now, True
    if spoke:
        stream.write(f"{desc}: {done}{of} done in {_elapsed(time.monotonic() - t0)}\n")
        stream.flush()


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)} min {secs:04.1f} s" if minutes >= 1 else f"{secs:.1f} s"


@contextlib.contextmanager
def phase(name: str, stream: TextIO | None = None, prefix: str = "") -> Iterator[None]:
    """On a terminal: one line when the phase starts and one with its elapsed time when it ends.
    Everywhere: a line every ``HEARTBEAT_S`` while it runs. Off a terminal a phase that ends
    before its first heartbeat prints nothing (a one-line error stays one line)."""
    stream = sys.stderr if stream is None else stream
    on, tty = not quiet(), shown(stream)
    t0 = time.monotonic()
    ended = threading.Event()
    spoke = [tty]  # whether this phase has printed a line (so its end is printed too)
    if on and tty:
        stream.write(f"{prefix}{name} ...\n")
        stream.flush()
    if on:

        def beat() -> None:
            while not ended.wait(HEARTBEAT_S):
                stream.write(f"{prefix}{name} still running after {_elapsed(time.monotonic() - t0)}\n")
                stream.flush()
                spoke[0] = True

        threading.Thread(target=beat, name="modal_rl-progress", daemon=True).start()
    try:
        yield
    except BaseException:
        ended.set()
        if on and spoke[0]:
            stream.write(f"{prefix}{name} failed after {_elapsed(time.monotonic() - t0)}\n")
            stream.flush()
        raise
    ended.set()
    if on and spoke[0]:
        stream.write(f"{prefix}{name} done in {_elapsed(time.monotonic() - t0)}\n")
        stream.flush()
