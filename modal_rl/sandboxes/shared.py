"""Pools for framework glue that has no place to own one.

- :func:`shared_pool`: one pool per (event loop, settings), created lazily inside the running
  loop, closed at interpreter exit by the pool's own atexit/signal teardown. verl calls its
  reward function / tool from its own long-lived worker event loops.
- :func:`process_pool`: one pool per (process, settings) on this module's own event loop (a
  daemon thread started once per process); the caller runs its sandbox work there with
  :func:`on_pool_loop`. For callers whose loops come and go (slime's contract tests use
  ``asyncio.run`` per call): no caller's loop shutdown cancels sandbox work mid-flight. At
  interpreter exit the pool is closed on its loop (that thread is a daemon, alive during
  atexit); if that fails, its sandboxes are killed.

Settings come from keyword arguments, falling back to environment variables:
``MODAL_RL_SANDBOX_BACKEND`` (local|modal), ``MODAL_RL_SANDBOX_IMAGE``,
``MODAL_RL_SANDBOX_MIN_WARM``, ``MODAL_RL_SANDBOX_MAX_LIVE``, ``MODAL_RL_SANDBOX_MEMORY_MB``,
``MODAL_RL_SANDBOX_NETWORK`` (0|1), ``MODAL_RL_SANDBOX_APP`` (Modal app name).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from collections.abc import Awaitable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.providers import PROVIDERS
from modal_rl.sandboxes.spec import SandboxSpec
from modal_rl.settings import read

log = logging.getLogger(__name__)

CLOSE_AT_EXIT_S = 10.0

_POOLS: dict[tuple, SandboxPool] = {}
_REGISTERED: set[int] = set()
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()
T = TypeVar("T")


def settings(**overrides: Any) -> dict[str, Any]:
    """Resolved pool settings: explicit values win over the environment, then defaults."""
    out = {
        "backend": read("MODAL_RL_SANDBOX_BACKEND"),
        "image": read("MODAL_RL_SANDBOX_IMAGE"),
        "min_warm": read("MODAL_RL_SANDBOX_MIN_WARM"),
        "max_live": read("MODAL_RL_SANDBOX_MAX_LIVE"),
        "memory_mb": read("MODAL_RL_SANDBOX_MEMORY_MB"),
        "network": read("MODAL_RL_SANDBOX_NETWORK"),
        "app": read("MODAL_RL_SANDBOX_APP"),
        "timeout_s": 600.0,
        "cpu": 1.0,
        "name": "shared",
    }
    unknown = set(overrides) - set(out)
    if unknown:
        raise ValueError(f"unknown sandbox pool settings {sorted(unknown)}; known: {sorted(out)}")
    out.update({k: v for k, v in overrides.items() if v is not None})
    PROVIDERS.target(out["backend"])  # an unknown backend fails here, naming the known ones
    return out


async def shared_pool(**overrides: Any) -> SandboxPool:
    """The started pool for these settings in the running event loop (created on first use)."""
    cfg = settings(**overrides)
    key = (id(asyncio.get_running_loop()), tuple(sorted((k, repr(v)) for k, v in cfg.items())))
    pool = _POOLS.get(key)
    if pool is None or pool._closed:
        provider = PROVIDERS.load(cfg["backend"]).from_settings(cfg)
        spec = SandboxSpec(
            image=cfg["image"],
            cpu=cfg["cpu"],
            memory_mb=cfg["memory_mb"],
            timeout_s=cfg["timeout_s"],
            network=cfg["network"],
        )
        pool = SandboxPool(
            provider,
            spec,
            min_warm=cfg["min_warm"],
            max_warm=max(cfg["min_warm"], cfg["max_live"]),
            max_live=cfg["max_live"],
            name=cfg["name"],
        )
        await pool.start()
        _POOLS[key] = pool
    return pool


async def close_shared_pools() -> None:
    """Close every shared pool of the running loop (tests, orderly shutdown)."""
    loop_id = id(asyncio.get_running_loop())
    for key in [k for k in _POOLS if k[0] == loop_id]:
        await _POOLS.pop(key).close()


def pool_loop() -> asyncio.AbstractEventLoop:
    """This process's sandbox-pool event loop (a daemon thread, started on first use)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="modal-rl-sandbox-pool", daemon=True).start()
            _LOOP = loop
        return _LOOP


async def on_pool_loop(coro: Awaitable[T]) -> T:
    """Await ``coro`` on the pool loop from any loop; cancelling the caller cancels it there."""
    loop = pool_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def _close_at_exit(pool: SandboxPool, loop: asyncio.AbstractEventLoop) -> None:
    if pool._closed:
        return
    if loop.is_running() and not loop.is_closed():
        try:
            asyncio.run_coroutine_threadsafe(pool.close(), loop).result(CLOSE_AT_EXIT_S)
            return
        except (FutureTimeout, RuntimeError) as exc:
            log.warning("sandbox pool %s: close at exit failed (%s); killing its sandboxes", pool.name, exc)
    pool.kill_all_now()


async def _pool_here(settings_: dict[str, Any]) -> SandboxPool:
    pool = await shared_pool(**settings_)
    if id(pool) not in _REGISTERED:
        _REGISTERED.add(id(pool))
        atexit.register(_close_at_exit, pool, asyncio.get_running_loop())
    return pool


async def process_pool(**overrides: Any) -> SandboxPool:
    """This process's started pool for these settings, closed at exit.

    The pool belongs to the pool loop: use it only inside coroutines run with ``on_pool_loop``."""
    return await on_pool_loop(_pool_here(overrides))


async def close_process_pools() -> None:
    """Close this process's pools now (tests, orderly shutdown); the next use starts a new one."""
    await on_pool_loop(close_shared_pools())
