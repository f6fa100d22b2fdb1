"""Online sizing of the warm buffer.

The pool keeps ``target()`` sandboxes ready-or-starting and unleased (a base-stock level):
every claim takes one and starts a replacement, so a consumer waits only when more than
``target`` replacements are still in flight. Inputs are measured online: the claim rate
(sliding window), the create→ready time and the start failure rate (last N starts).

Two policies:

- ``"p99"`` - the issue's rule, ``claims/s × p99(ready) × (1 + failure rate)``: every
  replacement is assumed to take the p99 time. Simple, never short, but with a heavy-tailed
  start time (Modal: p99/mean ≈ 5.5) it keeps several times more sandboxes than needed.
- ``"lead-time"`` (default) - the same three measurements, used as inventory theory does:
  with independent start times, the replacements in flight are Poisson with mean
  ``claims/s × mean(ready) × (1 + failure rate)`` (M/G/∞, any start-time distribution), so the
  target is that Poisson's ``service_level`` quantile. Measured side by side with ``p99`` in
  ``python -m benchmarks sandboxes`` (simulation with Modal's published latencies).
"""

from __future__ import annotations

import math
import time
from collections import deque

POLICIES = ("lead-time", "p99")


def poisson_quantile(mean: float, q: float) -> int:
    """Smallest k with P(Poisson(mean) <= k) >= q (normal approximation above mean 500)."""
    if mean <= 0:
        return 0
    if mean > 500:
        z = math.sqrt(2) * _erfinv(2 * q - 1)
        return math.ceil(mean + z * math.sqrt(mean) + 0.5)
    term = cdf = math.exp(-mean)
    k = 0
    while cdf < q:
        k += 1
        term *= mean / k
        cdf += term
    return k


def _erfinv(y: float) -> float:
    # Newton on erf; only used for large means where accuracy to 1e-6 is plenty.
    x = 0.0
    for _ in range(50):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


def percentile(values, q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in [0, 100]); NaN when empty."""
    data = sorted(values)
    if not data:
        return math.nan
    return data[min(len(data) - 1, max(0, math.ceil(q / 100 * len(data)) - 1))]


class WarmSizer:
    """Measures claims and starts; ``target(now)`` is the warm+starting level to hold.

    Invariant: ``min_warm <= target(now) <= max_warm`` always. Before the first start is
    measured, ``prior_ready_s`` stands in for the start time.
    """

    def __init__(
        self,
        min_warm: int = 0,
        max_warm: int = 64,
        *,
        policy: str = "lead-time",
        service_level: float = 0.999,
        window_s: float = 30.0,
        history: int = 256,
        prior_ready_s: float = 1.0,
    ):
        if policy not in POLICIES:
            raise ValueError(f"WarmSizer policy must be one of {POLICIES}, got {policy!r}")
        if not (0 <= min_warm <= max_warm):
            raise ValueError(f"WarmSizer needs 0 <= min_warm <= max_warm, got {min_warm}, {max_warm}")
        if not (0.5 <= service_level < 1):
            raise ValueError(f"service_level must be in [0.5, 1), got {service_level!r}")
        self.min_warm, self.max_warm, self.policy = min_warm, max_warm, policy
        self.service_level, self.window_s, self.prior_ready_s = service_level, window_s, prior_ready_s
        self._claims: deque[float] = deque()
        self._first_claim: float | None = None
        self._ready: deque[float] = deque(maxlen=history)
        self._outcomes: deque[bool] = deque(maxlen=history)

    def record_claim(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._first_claim = now if self._first_claim is None else self._first_claim
        self._claims.append(now)

    def record_start(self, ready_s: float | None) -> None:
        """One finished start attempt: its create→ready seconds, or None if it failed."""
        self._outcomes.append(ready_s is not None)
        if ready_s is not None:
            self._ready.append(ready_s)

    def claim_rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._claims and self._claims[0] < now - self.window_s:
            self._claims.popleft()
        if self._first_claim is None:
            return 0.0
        # Divide by the time actually observed (at least 1 s), not the whole window, so the
        # first burst of claims is seen at its real rate.
        span = max(1.0, min(self.window_s, now - self._first_claim))
        return len(self._claims) / span

    def failure_rate(self) -> float:
        return 0.0 if not self._outcomes else 1 - sum(self._outcomes) / len(self._outcomes)

    def ready_mean(self) -> float:
        return sum(self._ready) / len(self._ready) if self._ready else self.prior_ready_s

    def ready_p99(self) -> float:
        return percentile(self._ready, 99) if self._ready else self.prior_ready_s

    def target(self, now: float | None = None) -> int:
        rate = self.claim_rate(now)
        if self.policy == "p99":
            raw = math.ceil(rate * self.ready_p99() * (1 + self.failure_rate()))
        else:
            raw = poisson_quantile(rate * self.ready_mean() * (1 + self.failure_rate()), self.service_level)
        return max(self.min_warm, min(self.max_warm, raw))

    def snapshot(self, now: float | None = None) -> dict:
        return {
            "policy": self.policy,
            "claims_per_s": self.claim_rate(now),
            "ready_mean_s": self.ready_mean(),
            "ready_p99_s": self.ready_p99(),
            "failure_rate": self.failure_rate(),
            "target": self.target(now),
        }
