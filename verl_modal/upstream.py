"""Which of our upstream verl fixes (``patches/verl/``) the installed verl already has.

Each check looks for the fix itself in the installed code (a function or field the patch
adds, or the absence of the bug), never at a version string, so a verl that merged the fix,
a fork that cherry-picked it, and our patched sdist all count. The adapters ask here and keep
their run-time shim only where the answer is False:

- ``flush_fixed``: ``trainer_separate_async`` has no ``logger.<level>(..., flush=...)`` call
  (patch 0001) -> :func:`verl_modal.runner.quiet_separate_async_info_log` leaves the level alone;
- ``pause_mode_aware``: verl's vLLM rollout utils define ``pause_generation_abort_kwargs``
  (patch 0002) -> :mod:`verl_modal.cpu.patches` does not wrap ``AsyncLLM.pause_generation``;
- ``checkpoint_manager_class``: the v1 ``PPOTrainer`` builds its managers through
  ``_create_checkpoint_manager`` (patch 0004);
- ``pool_wait``: ``ResourcePoolManager`` has ``wait_timeout_s`` and verl names its env var
  (patch 0005) -> :func:`verl_modal.pools.install` hands the wait to verl.

Invariants: the source checks read files only (no import of vLLM-heavy modules, so they are
safe inside an import hook); a module that cannot be found counts as "not fixed"; results
are cached per process (the installed code does not change under a running process).
"""

from __future__ import annotations

import ast
import functools
import importlib.util

SEPARATE_ASYNC = "verl.trainer.ppo.v1.trainer_separate_async"
VLLM_UTILS = "verl.workers.rollout.vllm_rollout.utils"
TRAINER_BASE = "verl.trainer.ppo.v1.trainer_base"
POOL_BASE = "verl.single_controller.ray.base"
_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical"}


def _tree(module: str) -> ast.Module | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=spec.origin)


def _defines(tree: ast.Module | None, name: str, in_class: str | None = None) -> bool:
    if tree is None:
        return False
    body = tree.body
    if in_class is not None:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == in_class]
        body = classes[0].body if classes else []
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in body)


@functools.cache
def flush_fixed() -> bool:
    """No logging call in verl's ``separate_async`` trainer passes ``flush=``."""
    tree = _tree(SEPARATE_ASYNC)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _LOG_METHODS
            and any(kw.arg == "flush" for kw in node.keywords)
        ):
            return False
    return True


@functools.cache
def pause_mode_aware() -> bool:
    """verl picks ``pause_generation``'s keyword from the running vLLM's signature."""
    return _defines(_tree(VLLM_UTILS), "pause_generation_abort_kwargs")


@functools.cache
def checkpoint_manager_class() -> bool:
    """verl's v1 trainers honour ``actor_rollout_ref.rollout.checkpoint_manager_class``."""
    return _defines(_tree(TRAINER_BASE), "_create_checkpoint_manager", in_class="PPOTrainer")


def pool_wait_env() -> str | None:
    """The env var verl's ``ResourcePoolManager`` reads its wait from, when it can wait."""
    try:
        base = importlib.import_module(POOL_BASE)
    except ImportError:
        return None
    fields = getattr(base.ResourcePoolManager, "__dataclass_fields__", {})
    env = getattr(base, "RESOURCE_POOL_WAIT_TIMEOUT_ENV", None)
    return env if "wait_timeout_s" in fields and isinstance(env, str) else None


def seams() -> dict[str, bool]:
    """Every check, for logs and tests."""
    return {
        "flush_fixed": flush_fixed(),
        "pause_mode_aware": pause_mode_aware(),
        "checkpoint_manager_class": checkpoint_manager_class(),
        "pool_wait": pool_wait_env() is not None,
    }
