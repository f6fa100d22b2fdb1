"""One shape for "check, and if it is not done yet, wait a little and check again, until a
deadline": :func:`wait_for`.

The callers keep their own words for a timeout (each names what did not happen and the fix),
so the helper returns what the check returned, or None when the time ran out, and raises
nothing of its own.

Invariants: the check runs at least once, even with ``timeout_s`` 0, and once more at or
after the deadline (a condition that became true while we slept is seen); sleeps never run
past the deadline; time is ``time.monotonic`` (a wall-clock jump changes nothing); an
exception from the check passes through unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout_s: float, poll_s: float = 0.1) -> T | None:
    """``check()``'s first truthy result, polling every ``poll_s`` for up to ``timeout_s``
    seconds; None when it stayed falsy that long."""
    if poll_s <= 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
    deadline = time.monotonic() + max(0.0, float(timeout_s))
    while True:
        got = check()
        if got:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(poll_s, left))
