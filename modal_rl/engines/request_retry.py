"""Sending one request through an ``EngineSupervisor``: retried on the same weight version, or lost.

Invariants:
- a request is only ever sent to an engine the supervisor hands out (serving the current
  version); a retry goes to an engine holding the *same* version as the first attempt, or not
  at all (``EngineLost``), so an answer never mixes or swaps weights behind the caller's back;
- an attempt whose engine is lost while it runs is cancelled within ``check_s`` of the loss
  being detected (a hung engine never holds a request longer than detection takes);
- after ``attempts`` tries, or when no engine of that version comes back within ``wait_s``,
  ``EngineLost`` is raised: the adapter turns it into a masked sample.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from modal_rl.engines.state import EngineLost


async def run(supervisor, send, *, wait_s: float, attempts: int = 3, check_s: float = 0.5, transient=()):
    """``await send(lease)`` on a serving engine; a transport failure, or the engine being
    lost meanwhile, retries on an engine of the *same* weight version (up to ``attempts``
    in all). Returns ``(result, lease)``; raises ``EngineLost`` when it cannot (the caller
    masks the sample). ``transient``: the client library's connection errors, beyond
    ``OSError``/``TimeoutError``. Errors the engine *answered* (HTTP 4xx/5xx from a live
    server) are the caller's: ``send`` raises them as other exceptions and they pass through."""

    version: Any = ...
    why = "no attempt made"
    for _ in range(attempts):
        try:
            lease = supervisor.acquire(0.0, version)
        except EngineLost:
            lease = await asyncio.to_thread(supervisor.acquire, wait_s, version)
        version = lease.version
        task = asyncio.ensure_future(send(lease))
        while not task.done():
            await asyncio.wait({task}, timeout=check_s)
            if not task.done() and not supervisor.is_current(lease):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                why = f"engine {lease.index} was lost during the request"
                break
        if task.cancelled():
            continue
        try:
            result = task.result()
        except (OSError, TimeoutError, *transient) as exc:
            why = f"engine {lease.index}: {type(exc).__name__}: {exc}"
            await asyncio.to_thread(supervisor.report_failure, lease, why)
            continue
        supervisor.finished(lease)
        return result, lease
    raise EngineLost(f"request not served after {attempts} attempts ({why})")
