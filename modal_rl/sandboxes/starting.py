"""One sandbox start for a pool: rate-limited create, then readiness, each with its own timeout.

Invariants: a created sandbox is registered (``started[handle.id]``) before its probe runs, so a
close in between still terminates it; one that fails its probe is unregistered and reaped before
the error leaves; every failure is typed (``SandboxStartTimeout`` with kind ``create_timeout`` /
``ready_timeout``, ``SandboxStartError`` kind ``ready``) so the pool's retry policy can tell
them apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from modal_rl.sandboxes.errors import SandboxStartError, SandboxStartTimeout
from modal_rl.sandboxes.provider import SandboxHandle


async def start_one(
    pool: Any, started: dict[str, SandboxHandle], reap: Callable[[SandboxHandle], None]
) -> tuple[SandboxHandle, float]:
    """Start and probe one sandbox with ``pool``'s provider, spec, tags, bucket and timeouts;
    returns it and the seconds it took."""
    if pool.bucket is not None:
        await pool.bucket.acquire()
    t0 = time.monotonic()
    pool.metrics.record_create(t0)
    try:
        handle = await asyncio.wait_for(
            pool.provider.create(pool.spec, tags=pool.tags), pool.create_timeout_s
        )
    except TimeoutError:
        raise SandboxStartTimeout(
            f"create took longer than {pool.create_timeout_s}s", kind="create_timeout"
        ) from None
    started[handle.id] = handle
    try:
        await asyncio.wait_for(handle.ready(), pool.ready_timeout_s)
    except BaseException as exc:
        started.pop(handle.id, None)
        reap(handle)
        if isinstance(exc, TimeoutError):
            raise SandboxStartTimeout(
                f"not ready within {pool.ready_timeout_s}s", kind="ready_timeout"
            ) from None
        if isinstance(exc, Exception):
            raise SandboxStartError(f"readiness probe failed: {exc}", kind="ready", cause=exc) from exc
        raise
    return handle, time.monotonic() - t0
