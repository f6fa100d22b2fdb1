"""Discrete-event simulation of a rollout workload against a pool of slow, flaky sandboxes.

Provider model (Modal's published cold start): create→ready time lognormal with median 2.66 s
(σ = 0.91 fits p95 11.8 s and p99 22.4 s), 2% of creates fail (after their latency) and are
retried with exponential backoff, and at most 5 creates/s (token bucket, burst 5).
Workload: ``n_rollouts`` single-use claims arriving as a Poisson process of rate ``rate``.

Policies: ``none`` (every claim creates its own sandbox), ``fixed:N`` (hold N sandboxes
warm-or-starting, pre-warmed), ``adaptive`` (the pool's own ``WarmSizer``, fed the same
measurements the real pool feeds it, starting from ``min_warm``). A consumer waits from its
claim until a ready sandbox is handed to it (oldest waiter first). "Size" is the time-average of
sandboxes held ready-or-starting, the quantity a user pays for.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from modal_rl.sandboxes.sizing import WarmSizer

MEDIAN_S, P95_S, P99_S = 2.66, 11.8, 22.4
SIGMA = math.log(P99_S / MEDIAN_S) / 2.3263


@dataclass(frozen=True)
class ProviderModel:
    median_s: float = MEDIAN_S
    sigma: float = SIGMA
    failure_rate: float = 0.02
    creates_per_s: float = 5.0
    burst: int = 5
    backoff_s: float = 0.5


@dataclass
class SimResult:
    policy: str
    wait_s: float
    waited_claims: int
    max_wait_s: float
    mean_size: float
    creates: int


def simulate(
    policy: str,
    *,
    n_rollouts: int = 1000,
    rate: float = 2.0,
    rates: tuple[float, ...] | None = None,
    seed: int = 0,
    provider: ProviderModel | None = None,
    min_warm: int = 4,
    max_warm: int = 256,
    max_starting: int = 32,
    sizing: str = "lead-time",
) -> SimResult:
    p = provider or ProviderModel()
    rng_arr, rng_start = random.Random(seed), random.Random(seed + 10_007)
    arrivals, t = [], 0.0
    phases = rates or (rate,)  # equal shares of the rollouts arrive at each phase's rate
    for i in range(n_rollouts):
        t += rng_arr.expovariate(phases[i * len(phases) // n_rollouts])
        arrivals.append(t)
    # Start outcomes are drawn per start in order, so every policy faces the same provider luck.
    sizer = WarmSizer(min_warm, max_warm, policy=sizing, prior_ready_s=1.0) if policy == "adaptive" else None
    fixed = int(policy.split(":")[1]) if policy.startswith("fixed:") else 0
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(when, kind, data=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (when, seq, kind, data))

    for a in arrivals:
        push(a, "claim")
    warm = fixed  # fixed pools start full (pre-warmed); the adaptive pool starts at min_warm
    starting = 0
    waiters: list[float] = []
    wait_total, waited, max_wait, creates = 0.0, 0, 0.0, 0
    tokens, token_t = float(p.burst), 0.0
    area, last_t, served = 0.0, 0.0, 0
    if sizer is not None:
        warm = min_warm

    def take_token(now: float) -> float:
        nonlocal tokens, token_t
        tokens = min(p.burst, tokens + (now - token_t) * p.creates_per_s)
        token_t = now
        if tokens >= 1:
            tokens -= 1
            return now
        when = now + (1 - tokens) / p.creates_per_s
        tokens, token_t = 0.0, when  # the token that accrues until ``when`` is spent then
        return when

    def begin(now: float, attempt: int) -> None:
        nonlocal creates
        go = take_token(now)
        creates += 1
        dur = rng_start.lognormvariate(math.log(p.median_s), p.sigma)
        ok = rng_start.random() >= p.failure_rate
        push(go + dur, "ready" if ok else "failed", (attempt, go))

    def top_up(now: float) -> None:
        nonlocal starting
        if policy == "none":
            target = 0
        elif sizer is not None:
            target = sizer.target(now)
        else:
            target = fixed
        n = min(target + len(waiters) - (warm + starting), max_starting - starting)
        for _ in range(max(0, n)):
            starting += 1
            begin(now, 0)

    while events and served < n_rollouts:
        now, _, kind, data = heapq.heappop(events)
        area += (warm + starting) * (now - last_t)
        last_t = now
        if kind == "claim":
            if sizer is not None:
                sizer.record_claim(now)
            if warm > 0:
                warm -= 1
                served += 1
            else:
                waiters.append(now)
        elif kind == "ready":
            starting -= 1
            if sizer is not None:
                sizer.record_start(now - data[1])
            if waiters:
                w = now - waiters.pop(0)
                wait_total += w
                waited += 1
                max_wait = max(max_wait, w)
                served += 1
            else:
                warm += 1
        elif kind == "failed":
            if sizer is not None:
                sizer.record_start(None)
            attempt = data[0] + 1
            push(now + min(30.0, p.backoff_s * 2 ** (attempt - 1)), "retry", attempt)
        elif kind == "retry":
            begin(now, data)
        top_up(now)
    return SimResult(policy, wait_total, waited, max_wait, area / max(last_t, 1e-9), creates)


def oracle(n_rollouts: int, rate: float, seed: int, upper: int = 200, rates=None) -> tuple[int, SimResult]:
    """Smallest fixed pool with zero consumer wait (binary search; wait is monotone in N)."""
    lo, hi = 0, upper
    best = simulate(f"fixed:{hi}", n_rollouts=n_rollouts, rate=rate, seed=seed, rates=rates)
    if best.wait_s > 0:
        return hi, best
    while lo < hi:
        mid = (lo + hi) // 2
        r = simulate(f"fixed:{mid}", n_rollouts=n_rollouts, rate=rate, seed=seed, rates=rates)
        if r.wait_s == 0:
            hi, best = mid, r
        else:
            lo = mid + 1
    return hi, best
