"""Pool metrics: latencies over a recent window, counters, and a flat dict snapshot."""

from __future__ import annotations

import time
from collections import Counter, deque

from modal_rl.sandboxes.sizing import percentile


class PoolMetrics:
    """Counters since start plus the last ``history`` claim and start latencies."""

    def __init__(self, history: int = 1024):
        self.started_at = time.monotonic()
        self.claim_latency_s: deque[float] = deque(maxlen=history)
        self.ready_s: deque[float] = deque(maxlen=history)
        self.create_times: deque[float] = deque(maxlen=history)
        self.failures: Counter[str] = Counter()
        self.claims = 0
        self.creates_ok = 0
        self.terminated = 0
        self.consumer_wait_s = 0.0

    def record_claim(self, latency_s: float, waited: bool) -> None:
        self.claims += 1
        self.claim_latency_s.append(latency_s)
        if waited:
            self.consumer_wait_s += latency_s

    def record_create(self, now: float) -> None:
        self.create_times.append(now)

    def creates_per_s(self, now: float, window_s: float = 60.0) -> float:
        recent = [t for t in self.create_times if t >= now - window_s]
        span = min(window_s, max(now - self.started_at, 1e-9))
        return len(recent) / span

    def snapshot(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        return {
            "claims": self.claims,
            "claim_p50_s": percentile(self.claim_latency_s, 50),
            "claim_p99_s": percentile(self.claim_latency_s, 99),
            "ready_p50_s": percentile(self.ready_s, 50),
            "ready_p99_s": percentile(self.ready_s, 99),
            "creates_ok": self.creates_ok,
            "creates_per_s": self.creates_per_s(now),
            "failures": dict(self.failures),
            "terminated": self.terminated,
            "consumer_wait_s": self.consumer_wait_s,
        }
