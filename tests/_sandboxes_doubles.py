"""Test doubles for the provider port (fault injection). They are deliberately broken
providers; the sandboxes they do return are real bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import time

from modal_rl.sandboxes import (
    LocalProvider,
    Provider,
    RateLimitedError,
    SandboxPool,
    SandboxSpec,
    TransientProviderError,
)


class FailingProvider(Provider):
    """Every create fails: transiently (retryable) or permanently."""

    name = "failing"

    def __init__(self, transient: bool = True):
        self.transient, self.calls = transient, 0

    async def create(self, spec, *, tags):
        self.calls += 1
        await asyncio.sleep(0.001)
        if self.transient:
            raise TransientProviderError("injected: provider hiccup")
        raise ValueError("injected: image does not exist")

    async def sweep(self, tags):
        return 0


class RateLimitingProvider(LocalProvider):
    """A real LocalProvider that refuses creates closer than ``min_interval_s`` apart, like a
    provider enforcing its creates/s quota."""

    name = "ratelimiting"

    def __init__(self, min_interval_s: float, **kw):
        super().__init__(**kw)
        self.min_interval_s, self.last, self.rejected, self.accepted = min_interval_s, -1e9, 0, 0

    async def create(self, spec, *, tags):
        now = time.monotonic()
        if now - self.last < self.min_interval_s:
            self.rejected += 1
            raise RateLimitedError("injected: 429 too many creates", retry_after_s=self.min_interval_s)
        self.last = now
        self.accepted += 1
        return await super().create(spec, tags=tags)


class HangingReadyProvider(LocalProvider):
    """Real sandboxes whose readiness probe never answers."""

    name = "hanging"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.handles = []

    async def create(self, spec, *, tags):
        handle = await super().create(spec, tags=tags)

        async def never():
            await asyncio.sleep(3600)

        handle.ready = never
        self.handles.append(handle)
        return handle


class SlowCreateProvider(LocalProvider):
    """Real sandboxes that take ``delay_s`` to create."""

    name = "slow"

    def __init__(self, delay_s: float, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s

    async def create(self, spec, *, tags):
        await asyncio.sleep(self.delay_s)
        return await super().create(spec, tags=tags)


async def failing_pool(*args, **kw) -> SandboxPool:
    """Stands in for a glue module's pool factory: every sandbox fails to start, no retries."""
    return SandboxPool(
        FailingProvider(),
        SandboxSpec(),
        rate_limiter=False,
        max_retries=0,
        log_interval_s=0,
        handle_signals=False,
    )


class PermanentlyFailingProvider(FailingProvider):
    """Every create fails for good (an image that does not exist), built from pool settings."""

    name = "permanently-failing"

    def __init__(self):
        super().__init__(transient=False)
