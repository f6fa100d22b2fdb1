"""Warm-buffer sizing and the create-rate token buckets."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.sandboxes import FileTokenBucket, TokenBucket, WarmSizer
from modal_rl.sandboxes.sizing import percentile, poisson_quantile


@given(st.floats(0.01, 60), st.sampled_from([0.9, 0.99, 0.999]))
@settings(max_examples=60, deadline=None)
def test_poisson_quantile_is_smallest_k(mean, q):
    k = poisson_quantile(mean, q)

    def cdf(n):
        return sum(math.exp(-mean) * mean**i / math.factorial(i) for i in range(n + 1))

    assert cdf(k) >= q - 1e-12
    assert k == 0 or cdf(k - 1) < q


def test_poisson_quantile_large_mean_uses_normal():
    k = poisson_quantile(10_000, 0.999)
    assert 10_300 <= k <= 10_320  # 10000 + 3.09 * 100


def test_p99_policy_is_the_issue_formula():
    s = WarmSizer(0, 1000, policy="p99", window_s=10)
    for i in range(100):
        s.record_start(1.0 if i < 98 else 20.0)  # p99 = 20 s
    for _ in range(2):
        s.record_start(None)  # ~2% failures
    for i in range(50):
        s.record_claim(100.0 + i * 0.2)  # 5 claims/s over 10 s
    rate = s.claim_rate(110.0)
    assert rate == pytest.approx(5.0, rel=0.05)
    assert s.target(110.0) == math.ceil(rate * 20.0 * (1 + 2 / 102))


def test_lead_time_policy_and_bounds():
    s = WarmSizer(2, 30, policy="lead-time", window_s=10)
    assert s.target(0.0) == 2  # nothing measured: min_warm
    for _ in range(100):
        s.record_start(2.0)
    for i in range(50):
        s.record_claim(i * 0.2)
    assert s.target(10.0) == poisson_quantile(5.0 * 2.0, 0.999)
    for i in range(5000):
        s.record_claim(10 + i * 0.001)
    assert s.target(15.0) == 30  # capped at max_warm
    assert s.target(1000.0) == 2  # claims aged out of the window: back to min_warm
    with pytest.raises(ValueError, match="policy"):
        WarmSizer(policy="magic")


def test_percentile_nearest_rank():
    assert percentile(range(1, 101), 99) == 99
    assert percentile([5.0], 50) == 5.0 and math.isnan(percentile([], 50))


def test_token_bucket_rate():
    async def main():
        b = TokenBucket(rate=20, burst=2)
        t0 = time.monotonic()
        for _ in range(12):
            await b.acquire()
        return time.monotonic() - t0

    elapsed = asyncio.run(main())
    assert 0.45 <= elapsed < 2.0  # 2 from the burst, 10 more at 20/s


def _hammer(path, n, out):
    async def main():
        b = FileTokenBucket(path, rate=20, burst=1)
        for _ in range(n):
            await b.acquire()
            out.put(time.monotonic())

    asyncio.run(main())


def test_file_bucket_is_shared_across_processes(tmp_path):
    path = tmp_path / "bucket.json"
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(path, 8, q)) for _ in range(3)]
    for p in procs:
        p.start()
    stamps = sorted(q.get(timeout=30) for _ in range(24))
    for p in procs:
        p.join(timeout=30)
    # 24 tokens at 20/s with a burst of 1 take >= 23/20 s no matter how many processes ask.
    assert stamps[-1] - stamps[0] >= 23 / 20 * 0.95
    # ...and no window of 1 s saw more than rate + burst tokens.
    assert max(sum(1 for t in stamps if s <= t < s + 1.0) for s in stamps) <= 21


def test_penalize_blocks_tokens():
    async def main():
        b = TokenBucket(rate=100, burst=5)
        b.penalize(0.3)
        t0 = time.monotonic()
        await b.acquire()
        return time.monotonic() - t0

    assert asyncio.run(main()) >= 0.28
