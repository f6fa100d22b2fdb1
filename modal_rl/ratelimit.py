"""The project's one rate limiter: a token bucket, in-process or shared by every process on a host.

Used for sandbox creates (tokens = creates, ``modal_rl.sandboxes``) and for the weight-sync
frame server's byte rate (tokens = bytes, ``modal_rl.weightsync.transport.base``).

Invariants:
- ``rate`` tokens/s accrue up to ``burst``; ``rate=None`` means no limit (acquire returns at once);
- a request for ``n`` tokens waits until ``min(n, burst)`` are banked, then takes all ``n``
  (the balance may go negative, and later requests wait the debt off), so requests larger
  than the burst still pass at exactly ``rate`` on average;
- :meth:`TokenBucket.penalize` hands out nothing for the given seconds, also to requests
  already waiting (they re-check after each sleep rather than holding a reservation);
- the state is guarded by a lock (threads) and, in :class:`FileTokenBucket`, by ``flock`` on a
  small file (processes). Time is ``time.monotonic()``, one clock for all processes of a boot
  on Linux.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import threading
import time
from pathlib import Path


class TokenBucket:
    """In-process token bucket: ``rate`` tokens/s (None: unlimited), at most ``burst`` banked."""

    def __init__(self, rate: float | None, burst: float = 1):
        if (rate is not None and not rate > 0) or not burst >= 1:
            raise ValueError(f"TokenBucket needs rate > 0 and burst >= 1, got rate={rate!r}, burst={burst!r}")
        self.rate = None if rate is None else float(rate)
        self.burst = burst
        self._tokens, self._t = float(burst), time.monotonic()
        self._lock = threading.Lock()

    def _take(self, n: float = 1, penalty_s: float = 0.0) -> float:
        """Take ``n`` tokens (returns 0.0), or return the seconds to wait before asking again."""
        with self._lock:
            return self._update(n, penalty_s)

    def _update(self, n: float, penalty_s: float) -> float:
        now = time.monotonic()
        tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        if penalty_s > 0:
            tokens = min(tokens, -penalty_s * self.rate)
            wait = -1.0  # a penalty takes no token
        elif tokens >= min(n, self.burst):
            tokens, wait = tokens - n, 0.0
        else:
            wait = (min(n, self.burst) - tokens) / self.rate
        self._tokens, self._t = tokens, now
        return wait

    async def acquire(self, n: float = 1) -> float:
        """Wait for ``n`` tokens; returns the seconds waited."""
        waited = 0.0
        while self.rate is not None and (wait := self._take(n)) > 0:
            await asyncio.sleep(wait)
            waited += wait
        return waited

    def acquire_blocking(self, n: float = 1) -> float:
        """:meth:`acquire` for threads: sleeps instead of awaiting."""
        waited = 0.0
        while self.rate is not None and (wait := self._take(n)) > 0:
            time.sleep(wait)
            waited += wait
        return waited

    def penalize(self, seconds: float) -> None:
        """The provider said "rate limited": hand out no token for ``seconds``."""
        if self.rate is not None:
            self._take(penalty_s=seconds)


class FileTokenBucket(TokenBucket):
    """Token bucket whose state lives in ``path`` under an exclusive ``flock``: host-wide."""

    def __init__(self, path: Path | str, rate: float, burst: float = 1):
        if rate is None:
            raise ValueError("FileTokenBucket needs a rate (> 0)")
        super().__init__(rate, burst)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _take(self, n: float = 1, penalty_s: float = 0.0) -> float:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for microseconds: read, update, write
            with self._lock:
                try:
                    state = json.loads(os.pread(fd, 4096, 0) or b"null")
                    self._tokens, self._t = float(state["tokens"]), float(state["t"])
                except (ValueError, TypeError, KeyError):
                    self._tokens, self._t = float(self.burst), time.monotonic()
                wait = self._update(n, penalty_s)
                data = json.dumps({"tokens": self._tokens, "t": self._t}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return wait
        finally:
            os.close(fd)  # closing releases the lock
