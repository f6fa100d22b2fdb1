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

One pool per rollout process: slime runs every reward call of a process on one background
event loop (``slime.utils.async_utils``), and ``shared_pool`` keeps one pool per loop and
settings. At interpreter exit the pool is closed on its own loop if that loop still runs
(slime's loop thread is a daemon, alive during atexit); otherwise its sandboxes are killed.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.shared import settings, shared_pool

log = logging.getLogger(__name__)

SANDBOX_KEY = "modal_rl_sandbox"
REWARD_KEY = "modal_rl_reward"
CLOSE_AT_EXIT_S = 10.0

_REGISTERED: set[int] = set()


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


async def rollout_pool(args: Any = None, **overrides: Any) -> SandboxPool:
    """This process's started pool for ``args``' settings (``overrides`` win), closed at exit."""
    pool = await shared_pool(**{**sandbox_settings(args), **overrides})
    if id(pool) not in _REGISTERED:
        _REGISTERED.add(id(pool))
        atexit.register(_close_at_exit, pool, asyncio.get_running_loop())
    return pool
