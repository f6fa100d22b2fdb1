"""Create-rate limiting: a token bucket, in-process or shared by every process on a host.

The host-wide bucket keeps its state (tokens, timestamp) in a small file guarded by ``flock``,
so N pools in N processes together never exceed ``rate`` creates/s (plus ``burst``). Time is
``time.monotonic()``, which on Linux is one clock for all processes of a boot.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from pathlib import Path


class TokenBucket:
    """In-process token bucket: ``rate`` tokens/s, at most ``burst`` banked."""

    def __init__(self, rate: float, burst: int = 1):
        if not (rate > 0 and burst >= 1):
            raise ValueError(f"TokenBucket needs rate > 0 and burst >= 1, got rate={rate!r}, burst={burst!r}")
        self.rate, self.burst = float(rate), int(burst)
        self._tokens, self._t = float(burst), time.monotonic()

    def _take(self, penalty_s: float = 0.0) -> float:
        now = time.monotonic()
        tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        if penalty_s > 0:
            tokens = min(tokens, -penalty_s * self.rate)
            wait = -1.0  # a penalty takes no token
        elif tokens >= 1:
            tokens, wait = tokens - 1, 0.0
        else:
            wait = (1 - tokens) / self.rate
        self._tokens, self._t = tokens, now
        return wait

    async def acquire(self) -> float:
        """Wait for one token; returns the seconds waited."""
        waited = 0.0
        while (wait := self._take()) > 0:
            await asyncio.sleep(wait)
            waited += wait
        return waited

    def penalize(self, seconds: float) -> None:
        """The provider said "rate limited": hand out no token for ``seconds``."""
        self._take(penalty_s=seconds)


class FileTokenBucket(TokenBucket):
    """Token bucket whose state lives in ``path`` under an exclusive ``flock``: host-wide."""

    def __init__(self, path: Path | str, rate: float, burst: int = 1):
        super().__init__(rate, burst)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _take(self, penalty_s: float = 0.0) -> float:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for microseconds: read, update, write
            try:
                state = json.loads(os.pread(fd, 4096, 0) or b"null")
                self._tokens, self._t = float(state["tokens"]), float(state["t"])
            except (ValueError, TypeError, KeyError):
                self._tokens, self._t = float(self.burst), time.monotonic()
            wait = super()._take(penalty_s)
            data = json.dumps({"tokens": self._tokens, "t": self._t}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return wait
        finally:
            os.close(fd)  # closing releases the lock


def host_bucket(name: str, rate: float, burst: int) -> FileTokenBucket:
    """The default bucket every pool on this host shares for provider ``name``."""
    base = Path(os.environ.get("MODAL_RL_SANDBOX_REGISTRY", "/tmp/modal-rl-sandboxes"))
    return FileTokenBucket(base / f"ratelimit-{name}.json", rate, burst)
