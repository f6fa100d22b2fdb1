"""``SandboxPool``: a self-sizing warm buffer of sandboxes with leak-proof teardown.

Invariants:
- live (warm + starting + leased) never exceeds ``max_live``; starting never exceeds
  ``max_starting``; creates pass through the (by default host-wide) token bucket;
- a sandbox is handed out only after its readiness probe passed, while it is alive and has at
  least ``min_remaining_s`` of life left; with ``reuse=False`` (default) it is terminated on
  release and never handed out again;
- every start failure is typed: after its retries, a failed start fails the oldest waiting
  claim with ``SandboxStartError``; ``max_consecutive_failures`` failed attempts in a row stop
  refilling and fail every claim with one ``PoolFailedError``;
- every sandbox carries the pool and run tags; close, an exception in ``async with``,
  SIGINT/SIGTERM and interpreter exit all terminate every sandbox the pool created.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections import deque

from modal_rl.sandboxes.errors import (
    PoolClosedError,
    PoolFailedError,
    RateLimitedError,
    SandboxStartError,
    SandboxStartTimeout,
    TransientProviderError,
)
from modal_rl.sandboxes.lease import Sandbox, SandboxLease
from modal_rl.sandboxes.metrics import PoolMetrics
from modal_rl.sandboxes.pool_config import PoolConfig
from modal_rl.sandboxes.provider import TAG_POOL, TAG_RUN, Provider, SandboxHandle
from modal_rl.sandboxes.ratelimit import TokenBucket, host_bucket
from modal_rl.sandboxes.sizing import WarmSizer
from modal_rl.sandboxes.spec import SandboxSpec
from modal_rl.sandboxes.starting import start_one
from modal_rl.sandboxes.teardown import EmergencyTeardown

log = logging.getLogger("modal_rl.sandboxes")
RUN_ID = os.environ.get("MODAL_RL_RUN_ID") or f"run-{uuid.uuid4().hex[:10]}"


class SandboxPool:
    """Async pool of sandboxes of one ``spec`` from one ``provider``; use as ``async with``."""

    def __init__(self, provider: Provider, spec: SandboxSpec, config: PoolConfig | None = None, **settings):
        if not isinstance(spec, SandboxSpec):
            raise TypeError(f"spec must be a SandboxSpec, got {type(spec).__name__}")
        config = (config or PoolConfig()).with_settings(**settings) if settings else (config or PoolConfig())
        self.config = config
        self.provider, self.spec, self.name = provider, spec, config.name
        self.run_id = config.run_id or RUN_ID
        self.tags = {TAG_POOL: config.name, TAG_RUN: self.run_id}
        self.max_live, self.max_starting = config.max_live, config.max_starting
        self.sizer = config.sizer or WarmSizer(config.min_warm, min(config.max_warm, config.max_live))
        rate_limiter = config.rate_limiter
        if rate_limiter is True:
            rate_limiter = host_bucket(provider.name, provider.create_rate, provider.create_burst)
        self.bucket: TokenBucket | None = rate_limiter or None
        self.create_timeout_s = config.create_timeout_s
        self.ready_timeout_s = config.ready_timeout_s
        self.claim_timeout_s = config.claim_timeout_s
        # Never hand out a sandbox about to expire; default: 10% of its lifetime, at most 60 s.
        remaining = config.min_remaining_s
        self.min_remaining_s = min(60.0, 0.1 * spec.timeout_s) if remaining is None else remaining
        self.max_retries, self.backoff_s = config.max_retries, config.backoff_s
        self.backoff_max_s = config.backoff_max_s
        self.max_consecutive_failures = config.max_consecutive_failures
        self.log_interval_s, self.handle_signals = config.log_interval_s, config.handle_signals
        self.metrics = PoolMetrics()
        self._warm: deque[SandboxHandle] = deque()
        self._leased: set[SandboxHandle] = set()
        self._all: dict[str, SandboxHandle] = {}
        self._waiters: deque[asyncio.Future] = deque()
        self._starting = 0
        self._consecutive_failures = 0
        self._failed: PoolFailedError | None = None
        self._closed = self._started = False
        self._tasks: set[asyncio.Task] = set()
        self._reaping: set[asyncio.Task] = set()  # terminations: awaited on close, never cancelled
        self._wake: asyncio.Event | None = None
        self._teardown = EmergencyTeardown(self.kill_all_now, signals=config.handle_signals)

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._wake = asyncio.Event()
        self._spawn(self._refill_loop())
        if self.log_interval_s > 0:
            self._spawn(self._log_loop())
        self._teardown.install()

    async def close(self) -> None:
        """Terminate every sandbox this pool created and stop all background work (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(PoolClosedError(f"pool {self.name} closed"))
        self._waiters.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        handles = list(self._all.values())
        await asyncio.gather(*(h.terminate() for h in handles), *self._reaping, return_exceptions=True)
        self.metrics.terminated += len(handles)
        self._all.clear()
        self._warm.clear()
        self._leased.clear()
        self._teardown.remove()

    def kill_all_now(self) -> None:
        """Synchronous last resort (signal handler, atexit): kill every sandbox of this pool."""
        for handle in list(self._all.values()):
            with contextlib.suppress(Exception):
                handle.kill_now()
        with contextlib.suppress(Exception):
            self.provider.kill_starting_now()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _reap(self, handle: SandboxHandle) -> None:
        """Kill now (sync) and collect in the background; close() waits for the collection."""
        handle.kill_now()
        task = asyncio.ensure_future(handle.terminate())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    # -- claims ----------------------------------------------------------------------------
    def lease(self, *, reuse: bool = False) -> SandboxLease:
        """``async with pool.lease() as sb``; single-use unless ``reuse=True``."""
        return SandboxLease(self, reuse)

    async def acquire(self, *, reuse: bool = False) -> Sandbox:
        """Claim a ready sandbox (waiting if none is warm); pair with ``await sb.release()``.

        Raises ``SandboxStartError`` (incl. ``SandboxStartTimeout``, ``PoolFailedError``) or
        ``PoolClosedError``; the caller masks the sample."""
        if not self._started:
            await self.start()
        t0 = time.monotonic()
        self._check_open()
        self.sizer.record_claim(t0)
        handle, waited = self._pop_warm(), False
        if handle is None:
            waited = True
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            self._wake.set()
            try:
                handle = await asyncio.wait_for(fut, self.claim_timeout_s)
            except asyncio.CancelledError:
                # delivered just as the claim was cancelled: nobody holds it, so end it
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._spawn(self._release(fut.result(), reuse=False))
                raise
            except TimeoutError:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
                raise SandboxStartTimeout(
                    f"pool {self.name}: no sandbox ready within claim_timeout_s={self.claim_timeout_s}s",
                    kind="claim_timeout",
                ) from None
        self._leased.add(handle)
        self.metrics.record_claim(time.monotonic() - t0, waited)
        self._wake.set()
        return Sandbox(self, handle, reuse)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError(f"pool {self.name} is closed")
        if self._failed is not None:
            raise self._failed

    def _usable(self, handle: SandboxHandle) -> bool:
        return handle.is_alive() and handle.remaining_s() >= self.min_remaining_s

    def _pop_warm(self) -> SandboxHandle | None:
        while self._warm:
            handle = self._warm.popleft()
            if self._usable(handle):
                return handle
            self._retire(handle)  # dead or too close to its end of life: recycle
        return None

    def _retire(self, handle: SandboxHandle) -> None:
        self._all.pop(handle.id, None)
        self.metrics.terminated += 1
        self._reap(handle)

    async def _release(self, handle: SandboxHandle, *, reuse: bool) -> None:
        self._leased.discard(handle)
        if reuse and not self._closed and self._usable(handle):
            self._deliver(handle)
        elif handle.id in self._all:
            self._all.pop(handle.id, None)
            self.metrics.terminated += 1
            await handle.terminate()
        if self._wake is not None:
            self._wake.set()

    def _deliver(self, handle: SandboxHandle) -> None:
        """A ready sandbox goes to the oldest waiting claim, else into the warm buffer.
        Handed to a claim, it counts as leased at once: the claim resumes a few event-loop
        steps later, and a refill in between must not see room for one more (a CI run saw
        4 live in a pool of 3 that way)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self._leased.add(handle)
                fut.set_result(handle)
                return
        self._warm.append(handle)

    # -- refill ----------------------------------------------------------------------------
    async def _refill_loop(self) -> None:
        while not self._closed:
            self._top_up()
            self._wake.clear()
            # Re-evaluate at least every 0.5 s: the target moves with the measured rates.
            # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation that
            # lands as its timeout fires, and this loop would then outlive its event loop.
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({woken}, timeout=0.5)
            finally:
                woken.cancel()

    def _top_up(self) -> None:
        if self._closed or self._failed is not None:
            return
        want = self.sizer.target() + sum(not f.done() for f in self._waiters)
        have = len(self._warm) + self._starting
        live = have + len(self._leased)
        n = min(want - have, self.max_live - live, self.max_starting - self._starting)
        for _ in range(max(0, n)):
            self._starting += 1
            self._spawn(self._start_one())

    async def _start_one(self) -> None:
        try:
            last: BaseException | None = None
            kind = "create"
            for attempt in range(self.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self._backoff(attempt, last))
                if self._failed is not None or self._closed:
                    return  # the pool gave up meanwhile; its waiters already have the error
                try:
                    handle, ready_s = await self._attempt_start()
                except (TransientProviderError, SandboxStartError) as exc:  # timeouts, readiness: retry
                    last, kind = (
                        exc,
                        getattr(
                            exc, "kind", "rate_limit" if isinstance(exc, RateLimitedError) else "transient"
                        ),
                    )
                    if not self._note_failure(kind, exc):
                        return
                    continue
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # permanent: do not retry
                    last, kind = exc, getattr(exc, "kind", "create")
                    self._note_failure(kind, exc)
                    break
                if self._closed:  # close() raced with this start: never let it outlive the pool
                    self._all.pop(handle.id, None)
                    self._reap(handle)
                    return
                self._consecutive_failures = 0
                self.sizer.record_start(ready_s)
                self.metrics.ready_s.append(ready_s)
                self.metrics.creates_ok += 1
                self._deliver(handle)
                return
            cls = SandboxStartTimeout if isinstance(last, SandboxStartTimeout) else SandboxStartError
            self._fail_oldest_waiter(
                cls(f"pool {self.name}: sandbox start failed ({kind}): {last}", kind=kind, cause=last)
            )
        finally:
            self._starting -= 1
            if self._wake is not None:
                self._wake.set()

    async def _attempt_start(self) -> tuple[SandboxHandle, float]:
        return await start_one(self, self._all, self._reap)

    def _backoff(self, attempt: int, exc: BaseException | None) -> float:
        if isinstance(exc, RateLimitedError) and exc.retry_after_s:
            return min(self.backoff_max_s, exc.retry_after_s)
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))

    def _note_failure(self, kind: str, exc: BaseException) -> bool:
        """Count one failed attempt; returns False once the pool has given up."""
        self.metrics.failures[kind] += 1
        self.sizer.record_start(None)
        if isinstance(exc, RateLimitedError) and self.bucket is not None:
            self.bucket.penalize(exc.retry_after_s or self.backoff_s)
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.max_consecutive_failures and self._failed is None:
            self._failed = PoolFailedError(
                f"pool {self.name}: {self._consecutive_failures} sandbox starts failed in a row; "
                f"stopped refilling. Last error ({kind}): {exc}",
                kind="pool_failed",
                cause=exc,
            )
            log.error("%s", self._failed)
            for fut in self._waiters:
                if not fut.done():
                    fut.set_exception(self._failed)
            self._waiters.clear()
        return self._failed is None

    def _fail_oldest_waiter(self, error: SandboxStartError) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error)
                return

    # -- metrics ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        now = time.monotonic()
        return {
            "pool": self.name,
            "run": self.run_id,
            "live": len(self._warm) + self._starting + len(self._leased),
            "warm": len(self._warm),
            "starting": self._starting,
            "leased": len(self._leased),
            "waiting": sum(not f.done() for f in self._waiters),
            "failed": self._failed is not None,
            **self.metrics.snapshot(now),
            "sizing": self.sizer.snapshot(now),
        }

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval_s)
            log.info("sandbox pool %s", json.dumps(self.snapshot(), default=str))
