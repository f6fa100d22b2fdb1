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

One pool per rollout process (``modal_rl.sandboxes.shared.process_pool``), on its own event
loop: slime's rollout loop (one per process, ``slime.utils.async_utils``) and a caller that uses
``asyncio.run`` per call (slime's contract tests) get the same pool; the glue runs its sandbox
work on that loop (``on_pool_loop``). It is closed at interpreter exit.
"""

from __future__ import annotations

from typing import Any

from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.shared import close_process_pools, process_pool, settings
from modal_rl.settings import read

SANDBOX_KEY = "modal_rl_sandbox"
REWARD_KEY = "modal_rl_reward"


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
    timeout_s = given.get("timeout_s", read("MODAL_RL_REWARD_TIMEOUT_S"))
    partial = given.get("partial", read("MODAL_RL_REWARD_PARTIAL"))
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ValueError(f"{REWARD_KEY}.timeout_s must be a positive number, got {timeout_s!r}")
    if not isinstance(partial, bool):
        raise ValueError(f"{REWARD_KEY}.partial must be true or false, got {partial!r}")
    return float(timeout_s), partial


async def rollout_pool(args: Any = None, **overrides: Any) -> SandboxPool:
    """This process's started pool for ``args``' settings (``overrides`` win), closed at exit.

    The pool belongs to the pool loop: use it only inside coroutines run with ``on_pool_loop``."""
    return await process_pool(**{**sandbox_settings(args), **overrides})


close_rollout_pools = close_process_pools
