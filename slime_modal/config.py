"""Sandbox and reward settings for the slime glue, and the rollout process's sandbox pool.

slime's ``--custom-config-path`` YAML sets each top-level key as an attribute of ``args``
(``slime/utils/arguments.py``), so the glue reads two mappings from ``args``:

    modal_rl_sandbox:          # SandboxPool settings (modal_rl.sandboxes.shared.settings)
      backend: modal           # local (bubblewrap, default) | modal
      image: python:3.11-slim
      min_warm: 8
      max_live: 256
      memory_mb: 1024
      network: false
      app: modal-rl-sandboxes  # Modal app that owns the sandboxes
      timeout_s: 600           # sandbox lifetime
      cpu: 1.0
    modal_rl_reward:
      timeout_s: 10            # per test-case run (env MODAL_RL_REWARD_TIMEOUT_S)
      partial: false           # score = pass fraction instead of all-or-nothing (env MODAL_RL_REWARD_PARTIAL=1)

Keys not given fall back to the ``MODAL_RL_SANDBOX_*`` / ``MODAL_RL_REWARD_*`` environment, then
defaults. Unknown keys and wrongly typed values raise ``ValueError`` naming the key.

One pool per rollout process, on its own event loop: the pool lives on a daemon thread this
module starts once per process, and the glue runs its sandbox work there (``on_pool_loop``).
So the pool does not depend on the caller's loop: slime's rollout loop (one per process,
``slime.utils.async_utils``) and a caller that uses ``asyncio.run`` per call (slime's contract
tests) get the same pool, and no caller's loop shutdown cancels sandbox work mid-flight. At
interpreter exit the pool is closed on its loop (that thread is a daemon, alive during atexit);
if that fails, its sandboxes are killed.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from collections.abc import Awaitable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.shared import close_shared_pools, settings, shared_pool

log = logging.getLogger(__name__)

SANDBOX_KEY = "modal_rl_sandbox"
REWARD_KEY = "modal_rl_reward"
CLOSE_AT_EXIT_S = 10.0

_REGISTERED: set[int] = set()
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()
T = TypeVar("T")


def _mapping(args: Any, key: str) -> dict[str, Any]:
    raw = getattr(args, key, None) if args is not None else None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"custom config key {key!r} must be a mapping, got {type(raw).__name__}")
    return dict(raw)


def sandbox_settings(args: Any) -> dict[str, Any]:
    """The ``modal_rl_sandbox`` mapping of ``args``, checked against the pool's settings."""
    given = _mapping(args, SANDBOX_KEY)
    defaults = settings()
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{SANDBOX_KEY}: unknown keys {unknown}; known: {sorted(defaults)}")
    for key, value in given.items():
        want = type(defaults[key]) if defaults[key] is not None else str
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        ok = ok or (want is float and isinstance(value, int) and not isinstance(value, bool))
        if value is not None and not ok:
            raise ValueError(f"{SANDBOX_KEY}.{key} must be {want.__name__}, got {value!r}")
    settings(**given)  # value checks (e.g. backend)
    return given


def reward_settings(args: Any) -> tuple[float, bool]:
    """(per-run timeout in seconds, partial credit) from ``modal_rl_reward``, then the environment."""
    given = _mapping(args, REWARD_KEY)
    unknown = sorted(set(given) - {"timeout_s", "partial"})
    if unknown:
        raise ValueError(f"{REWARD_KEY}: unknown keys {unknown}; known: ['partial', 'timeout_s']")
    timeout_s = given.get("timeout_s", float(os.environ.get("MODAL_RL_REWARD_TIMEOUT_S", "10")))
    partial = given.get("partial", os.environ.get("MODAL_RL_REWARD_PARTIAL") == "1")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ValueError(f"{REWARD_KEY}.timeout_s must be a positive number, got {timeout_s!r}")
    if not isinstance(partial, bool):
        raise ValueError(f"{REWARD_KEY}.partial must be true or false, got {partial!r}")
    return float(timeout_s), partial


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


async def rollout_pool(args: Any = None, **overrides: Any) -> SandboxPool:
    """This process's started pool for ``args``' settings (``overrides`` win), closed at exit.

    The pool belongs to the pool loop: use it only inside coroutines run with ``on_pool_loop``."""
    return await on_pool_loop(_pool_here({**sandbox_settings(args), **overrides}))


async def close_rollout_pools() -> None:
    """Close this process's pools now (tests, orderly shutdown); the next use starts a new one."""
    await on_pool_loop(close_shared_pools())
