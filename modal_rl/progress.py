"""Progress on long work, for a person at a terminal: a bar (``tqdm``) over counted work, and
a line per phase with its elapsed time; nothing at all when the stream is not a terminal
(CI logs, pipes, files), so logs keep only the results.

    for case in bar(cases, desc="weight-sync cases"): ...
    with phase("making the tiny model"): ...    # "making the tiny model ... done in 3.2 s"

``MODAL_RL_PROGRESS=1`` forces progress on a non-terminal, ``=0`` turns it off everywhere.

Invariants: never changes what the wrapped work yields or raises; a phase that raises prints
``failed after`` with its time, then the exception propagates; tqdm is optional (no bar, the
plain iterable, without it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

ENV = "MODAL_RL_PROGRESS"


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
    """``iterable`` with a tqdm bar on ``stream`` (stderr) when :func:`shown`, else as it is."""
    stream = sys.stderr if stream is None else stream
    if not shown(stream):
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, file=stream)


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)} min {secs:04.1f} s" if minutes >= 1 else f"{secs:.1f} s"


@contextlib.contextmanager
def phase(name: str, stream: TextIO | None = None, prefix: str = "") -> Iterator[None]:
    """One line when the phase starts and one with its elapsed time when it ends."""
    stream = sys.stderr if stream is None else stream
    on = shown(stream)
    t0 = time.monotonic()
    if on:
        stream.write(f"{prefix}{name} ...\n")
        stream.flush()
    try:
        yield
    except BaseException:
        if on:
            stream.write(f"{prefix}{name} failed after {_elapsed(time.monotonic() - t0)}\n")
            stream.flush()
        raise
    if on:
        stream.write(f"{prefix}{name} done in {_elapsed(time.monotonic() - t0)}\n")
        stream.flush()
