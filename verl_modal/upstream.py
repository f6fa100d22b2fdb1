"""Which of our upstream verl fixes (``patches/verl/``) the installed verl already has.

Each check looks for the fix itself in the installed code (a function or field the patch
adds, or the absence of the bug), never at a version string, so a verl that merged the fix,
a fork that cherry-picked it, and our patched sdist all count. The adapters ask here and keep
their run-time shim only where the answer is False:

- ``flush_fixed``: ``trainer_separate_async`` has no ``logger.<level>(..., flush=...)`` call
  (patch 0001) -> :func:`verl_modal.runner.quiet_separate_async_info_log` leaves the level alone;
- ``pause_mode_aware``: verl's vLLM rollout utils define ``pause_generation_abort_kwargs``
  (patch 0002), or its vLLM server passes ``mode=`` itself (``patches/verl-main/0001``)
  -> :mod:`verl_modal.cpu.patches` does not wrap ``AsyncLLM.pause_generation``;
- ``checkpoint_manager_class``: the v1 ``PPOTrainer`` builds its managers through
  ``_create_checkpoint_manager`` (patch 0004);
- ``pool_wait``: ``ResourcePoolManager`` has ``wait_timeout_s`` and verl names its env var
  (patch 0005) -> :func:`verl_modal.pools.install` hands the wait to verl;
- ``pool_manager_class``: every place verl builds a pool manager asks
  ``resource_pool_manager_class()``, which reads a subclass's name from an env var
  (``patches/verl-main/0006``, ``patches/verl/0008``) -> :func:`verl_modal.pools.install`
  names our subclass there and swaps nothing;
- ``invalid_sample``: verl's V1 agent loop masks a sample whose reward result sets
  ``reward_extra_info["mask_sample"]`` (``patches/verl-main/0005``, NeMo Gym's name; the 0.9.1
  form, ``patches/verl/0007``, reads ``"invalid_sample"``) -> :mod:`verl_modal.sample_mask`
  leaves sandbox failures to verl;
- ``process_group_backend``: verl's default process-group backend gives a CPU platform the
  single backend ``"cpu:gloo"`` (``patches/verl-main/0004``, ``patches/verl/0006``) ->
  :mod:`verl_modal.cpu.patches` does not wrap ``torch.distributed.init_process_group``.

Invariants: the source checks read files only (no import of vLLM-heavy modules, so they are
safe inside an import hook); a module that cannot be found counts as "not fixed"; results
are cached per process (the installed code does not change under a running process).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os

SEPARATE_ASYNC = "verl.trainer.ppo.v1.trainer_separate_async"
VLLM_UTILS = "verl.workers.rollout.vllm_rollout.utils"
VLLM_SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server"
TRAINER_BASE = "verl.trainer.ppo.v1.trainer_base"
POOL_BASE = "verl.single_controller.ray.base"
DISTRIBUTED = "verl.utils.distributed"
AGENT_LOOP_TQ = "verl.trainer.ppo.v1.agent_loop_tq"
_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical"}


def _source_path(module: str) -> str | None:
    """The file of ``module`` found from its top package alone: ``find_spec`` of a submodule
    would import its parent packages, and these checks run inside verl's own plugin loading."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, *rest.split(".")) + ".py"
        if os.path.isfile(path):
            return path
    return None


def _tree(module: str) -> ast.Module | None:
    path = _source_path(module)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


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
    """verl pauses vLLM with ``mode=``: it picks the keyword from the running vLLM's signature
    (``patches/verl/0002``) or passes ``mode=`` itself (``patches/verl-main/0001``)."""
    if _defines(_tree(VLLM_UTILS), "pause_generation_abort_kwargs"):
        return True
    server = _tree(VLLM_SERVER)
    return server is not None and any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "pause_generation"
        and any(kw.arg == "mode" for kw in node.keywords)
        for node in ast.walk(server)
    )


@functools.cache
def checkpoint_manager_class() -> bool:
    """verl's v1 trainers honour ``actor_rollout_ref.rollout.checkpoint_manager_class``."""
    return _defines(_tree(TRAINER_BASE), "_create_checkpoint_manager", in_class="PPOTrainer")


# (function verl's agent loop calls, module constant naming the key): the default-branch
# form (patches/verl-main/0005) and the 0.9.1 form (patches/verl/0007)
_MASK_SEAMS = (("mask_flagged_sample", "MASK_SAMPLE_KEY"), ("exclude_invalid_sample", "INVALID_SAMPLE_KEY"))


@functools.cache
def invalid_sample_key() -> str | None:
    """The ``reward_extra_info`` key by which a reward result marks its sample as not to be
    trained on, when verl's V1 agent loop honours one (it defines one of :data:`_MASK_SEAMS`)."""
    tree = _tree(AGENT_LOOP_TQ)
    for function, constant in _MASK_SEAMS:
        if not _defines(tree, function):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == constant for t in node.targets)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                return node.value.value
    return None


@functools.cache
def process_group_backend() -> bool:
    """verl's default process-group backend names the CPU once on a CPU platform: a function of
    ``verl.utils.distributed`` holds the string ``"cpu:gloo"`` on its own (the bug only ever
    built it inside ``f"cpu:gloo,{device}:..."``, whose constant part is ``"cpu:gloo,"``).
    The fix lives in ``initialize_global_process_group_ray`` (``patches/verl/0006``) or in
    the ``default_process_group_backend`` helper both initializers call
    (``patches/verl-main/0004``), so every function of the module counts."""
    tree = _tree(DISTRIBUTED)
    if tree is None:
        return False
    return any(
        isinstance(n, ast.Constant) and n.value == "cpu:gloo"
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        for n in ast.walk(node)
    )


@functools.cache
def pool_manager_class_env() -> str | None:
    """The env var verl reads the ``ResourcePoolManager`` subclass it builds from, when every
    construction site asks ``resource_pool_manager_class()`` (``patches/verl-main/0006``,
    ``patches/verl/0008``): ``base.py`` defines that function and assigns the variable's name
    to ``RESOURCE_POOL_MANAGER_CLASS_ENV``."""
    tree = _tree(POOL_BASE)
    if not _defines(tree, "resource_pool_manager_class"):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(
                isinstance(t, ast.Name) and t.id == "RESOURCE_POOL_MANAGER_CLASS_ENV" for t in node.targets
            )
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    return None


def pool_wait_env() -> str | None:
    """The env var verl's ``ResourcePoolManager`` reads its wait from, when it can wait."""
    try:
        base = importlib.import_module(POOL_BASE)
    except ImportError:
        return None
    fields = getattr(base.ResourcePoolManager, "__dataclass_fields__", {})
    env = getattr(base, "RESOURCE_POOL_WAIT_TIMEOUT_ENV", None)
    return env if "wait_timeout_s" in fields and isinstance(env, str) else None


ONE_STEP_OFF_MAIN = "verl.experimental.one_step_off_policy.main_ppo"
ONE_STEP_OFF_TRAINER = "verl.experimental.one_step_off_policy.ray_trainer"


@functools.cache
def one_step_off_dumps_rollouts() -> bool:
    """verl's ``OneStepOffRayTrainer.__init__`` starts the executor its rollout dump
    (``trainer.rollout_data_dir``) submits to: it calls ``_init_dump_executor`` or its base's
    ``__init__``. In verl 0.9.1 (and main as of August 2026) it does neither, and a run with
    a dump directory fails at step 1 (``no attribute '_dump_executor'``). Not a patch of ours."""
    tree = _tree(ONE_STEP_OFF_TRAINER)
    classes = [n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef)]
    inits = [
        f
        for c in classes
        if c.name == "OneStepOffRayTrainer"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "__init__"
    ]
    if not classes or not inits:
        return bool(classes)  # no own __init__: the base's starts it
    calls = [n for n in ast.walk(inits[0]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return any(c.func.attr == "_init_dump_executor" for c in calls) or any(
        c.func.attr == "__init__" and isinstance(c.func.value, ast.Call) for c in calls
    )


def dumps_rollouts(main: str | None) -> bool:
    """Whether verl's main ``main`` (default: the PPO main) can write ``trainer.rollout_data_dir``."""
    return main != ONE_STEP_OFF_MAIN or one_step_off_dumps_rollouts()


def seams() -> dict[str, bool]:
    """Every check, for logs and tests."""
    return {
        "flush_fixed": flush_fixed(),
        "pause_mode_aware": pause_mode_aware(),
        "checkpoint_manager_class": checkpoint_manager_class(),
        "pool_wait": pool_wait_env() is not None,
        "pool_manager_class": pool_manager_class_env() is not None,
        "process_group_backend": process_group_backend(),
        "invalid_sample": invalid_sample_key() is not None,
    }
