"""One shared pool per (event loop, settings) for framework glue that has no place to own one.

verl calls a reward function / tool from its own worker event loops; slime calls its reward
function from the rollout manager's loop. Both get their pool here: created lazily inside the
running loop, closed at interpreter exit by the pool's own atexit/signal teardown.

Settings come from keyword arguments, falling back to environment variables:
``MODAL_RL_SANDBOX_BACKEND`` (local|modal), ``MODAL_RL_SANDBOX_IMAGE``,
``MODAL_RL_SANDBOX_MIN_WARM``, ``MODAL_RL_SANDBOX_MAX_LIVE``, ``MODAL_RL_SANDBOX_MEMORY_MB``,
``MODAL_RL_SANDBOX_NETWORK`` (0|1), ``MODAL_RL_SANDBOX_APP`` (Modal app name).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.spec import SandboxSpec

_POOLS: dict[tuple, SandboxPool] = {}


def settings(**overrides: Any) -> dict[str, Any]:
    """Resolved pool settings: explicit values win over the environment, then defaults."""
    env = os.environ
    out = {
        "backend": env.get("MODAL_RL_SANDBOX_BACKEND", "local"),
        "image": env.get("MODAL_RL_SANDBOX_IMAGE") or None,
        "min_warm": int(env.get("MODAL_RL_SANDBOX_MIN_WARM", "2")),
        "max_live": int(env.get("MODAL_RL_SANDBOX_MAX_LIVE", "64")),
        "memory_mb": int(env.get("MODAL_RL_SANDBOX_MEMORY_MB", "1024")),
        "network": env.get("MODAL_RL_SANDBOX_NETWORK", "0") == "1",
        "app": env.get("MODAL_RL_SANDBOX_APP", "modal-rl-sandboxes"),
        "timeout_s": 600.0,
        "cpu": 1.0,
        "name": "shared",
    }
    unknown = set(overrides) - set(out)
    if unknown:
        raise ValueError(f"unknown sandbox pool settings {sorted(unknown)}; known: {sorted(out)}")
    out.update({k: v for k, v in overrides.items() if v is not None})
    if out["backend"] not in ("local", "modal"):
        raise ValueError(f"sandbox backend must be 'local' or 'modal', got {out['backend']!r}")
    return out


async def shared_pool(**overrides: Any) -> SandboxPool:
    """The started pool for these settings in the running event loop (created on first use)."""
    cfg = settings(**overrides)
    key = (id(asyncio.get_running_loop()), tuple(sorted((k, repr(v)) for k, v in cfg.items())))
    pool = _POOLS.get(key)
    if pool is None or pool._closed:
        if cfg["backend"] == "modal":
            from modal_rl.sandboxes.modal_provider import ModalProvider

            provider = ModalProvider(app_name=cfg["app"])
        else:
            from modal_rl.sandboxes.local import LocalProvider

            provider = LocalProvider()
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
