"""Where the adapters still replace an upstream name at run time, and why.

The adapters are meant to subclass each framework's interfaces through seams; a swap
(``module.Name = ours``, ``Class.method = wrapper``) or a ``__qualname__`` rewrite is allowed
only where the seam does not exist yet. Every attribute assignment to something that is not
``self`` in ``verl_modal/`` and ``slime_modal/`` is listed here with its reason; a new
one fails this test until it is listed (and reviewed), and a listed one that is gone fails it
too, so the list shrinks as seams land. ``setattr(obj, name, ...)`` with a name other than the
adapters' idempotence marker counts the same.

slime_modal has no swap left outside its CPU boundary (``slime_modal/cpu``, used only by
``python -m slime_modal --cpu`` on a host without GPUs, where ``torch.cuda`` itself is answered on
the CPU for Megatron): the image's patch series goes in through the image builders'
``extra_steps`` parameter (it used to replace both ``build_image`` functions), and with slime's
rollout-manager seam (``patches/slime/0004``) our rollout actor is a subclass slime builds by
name. For that seam-present path the rule is checked mechanically, not by the list: no module
that path runs (``slime_modal/rollout_manager.py`` and every ``slime_modal`` module it imports,
transitively) assigns an attribute of, or ``setattr``s on, a name it imported (a module or an
upstream class), or rewrites a ``__qualname__``/``__name__``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("verl_modal", "slime_modal")

# (file, assigned target) -> why it is still there. Upstream-name swaps first.
ALLOWED = {
    # Fallback where verl lacks patches/verl-main/0006 (with it, install() swaps nothing:
    # tests/e2e/test_patches_seams.py): swapped in the five modules that construct one.
    ("verl_modal/pools.py", "module.ResourcePoolManager"): "until patches/verl-main/0006 is in verl",
    # Shims that stop once verl carries the fix (verl_modal.upstream detects it from source).
    ("verl_modal/cpu/patches.py", "dist.init_process_group"): "until patches/verl-main/0004 is in verl",
    ("verl_modal/cpu/patches.py", "cls.pause_generation"): "until patches/verl-main/0001 is in verl",
    ("verl_modal/cpu/patches.py", "ext._update_weights"): "CPU-only vLLM reload; no upstream seam proposed",
    ("verl_modal/sample_mask.py", "cls._compute_score"): "until patches/verl-main/0005 is in verl",
    # The colocated in-place sync (verl_modal/colocated_sync.py): verl builds its ServerAdapter
    # from a fixed table and calls update_weights from its own sync, with no hook between the
    # trainer's tensors and the engine; the wrap sends a delta where verl would reload.
    ("verl_modal/cpu/patches.py", "adapter.update_weights"): "no seam between verl's sync and the engine",
    (
        "verl_modal/colocated_sync.py",
        "setattr(cls, APPLY_METHOD)",
    ): "our rpc methods on verl's vLLM worker extension",
    ("verl_modal/colocated_sync.py", "setattr(cls, name)"): "our rpc methods on verl's vLLM worker extension",
    (
        "verl_modal/colocated_sync.py",
        "adapter._modal_rl_pusher",
    ): "our publisher, kept on the adapter it serves",
    ("verl_modal/colocated_sync.py", "adapter.metrics"): "the sync numbers verl's manager does not return",
    # verl's compute_advantage calls GRPO by this module name, not through its estimator
    # registry (every other estimator is wrapped in the registry itself); no seam proposed yet.
    (
        "verl_modal/group_advantage.py",
        "core_algos.compute_grpo_outcome_advantage",
    ): "GRPO is called by module name in verl's compute_advantage",
    # Method wraps with no seam proposed yet (the original always runs first): verl's trainer
    # drops the sync numbers a checkpoint engine returns in one of its modes, and its tracker
    # takes no extra per-step metrics from a plugin (issue 40; docs/report.md).
    (
        "verl_modal/step_metrics.py",
        "CheckpointEngineManager.update_weights",
    ): "no per-sync metrics seam in verl",
    ("verl_modal/step_metrics.py", "Tracking.log"): "no extra-metrics seam in verl's tracker",
    # verl's checkpoint-engine path sends a LoRA actor's base weights, never its adapter
    # (verl #7495); no seam lets a checkpoint engine ask for the adapter. The same wrapper
    # hands a sharded modal_delta engine the training engine (verl does that for the backend
    # "delta_sharded" only; seam proposed in patches/verl/0009, verl-main/0007).
    ("verl_modal/lora.py", "cls.update_weights"): "no adapter or training-engine seam in verl's sync",
    # Our own subclasses' names (not upstream classes): Ray shows these in its actor table.
    ("verl_modal/runner.py", "PoolTaskRunner.__qualname__"): "our subclass's name",
    ("verl_modal/runner.py", "PoolTaskRunner.__name__"): "our subclass's name",
    ("verl_modal/runner.py", "CpuTaskRunner.__qualname__"): "our subclass's name",
    ("verl_modal/runner.py", "CpuTaskRunner.__name__"): "our subclass's name",
    # Our own objects.
    ("verl_modal/colocated_sync.py", "update_weights.__modal_rl_inplace__"): "a mark on our own wrapper",
    ("verl_modal/checkpoint_engine.py", "engine._verified"): "our checkpoint engine's own list",
    ("verl_modal/replica.py", "engine.options"): "our VllmEngine (modal_rl.engines.vllm)",
    ("verl_modal/step_metrics.py", "rec.sender"): "our per-sync record",
    ("verl_modal/_post_import.py", "spec.loader"): "our import hook's loader on a found spec",
    ("verl_modal/pools.py", "placed.ranks"): "our dataclass",
    ("verl_modal/entry.py", "entry.config_args"): "our dataclass (the line's entry point)",
    ("verl_modal/entry.py", "entry.config_dir"): "our dataclass (the line's entry point)",
    ("verl_modal/entry.py", "entry.config_name"): "our dataclass (the line's entry point)",
    ("verl_modal/entry.py", "entry.via_run_ppo"): "our dataclass (the line's entry point)",
    ("verl_modal/preflight.py", "view.critic.model"): "a deep copy of the composed config the checks read",
    ("verl_modal/sample_mask.py", "out.response_mask"): "the masked sample's own field",
    ("verl_modal/sharded.py", "sub.source"): "our subscriber's connection, moved to a rank's new address",
    ("verl_modal/__main__.py", "args.command"): "our parsed arguments",
    # a trajectory's first/last version survive verl's resubmissions only in its clients
    (
        "verl_modal/async_versions.py",
        "base.generate",
    ): "no seam for a sample's version record in verl's client",
    (
        "verl_modal/async_versions.py",
        "partial.generate",
    ): "no seam for a sample's version record in verl's client",
    (
        "verl_modal/async_versions.py",
        "trainer._compute_metrics",
    ): "no extra-metrics seam in verl's v1 trainer",
    # verl's separation trainer (one-step-off's base): the updates and sync labels it runs,
    # and its step's metrics; no seam for either.
    (
        "verl_modal/async_versions.py",
        "setattr(trainer, name)",
    ): "no update-count or extra-metrics seam in verl's separation trainer",
    # A verl main picks its TaskRunner class in its own body; for the one call of an
    # in-process run, run_ppo gets ours in its place (restored after).
    ("verl_modal/runner.py", "main_ppo.run_ppo"): "no TaskRunner seam in verl's async mains",
    # verl's fully-async main builds its trainer and rollouter actors by module-level name in
    # its TaskRunner: ours (subclasses with our setup first) are put in their place there.
    ("verl_modal/runner.py", "Ours.__qualname__"): "our subclass's name",
    ("verl_modal/runner.py", "Ours.__name__"): "our subclass's name",
    ("verl_modal/runner.py", "setattr(Ours, _OURS)"): "a mark on our own subclass",
    # the fully-async trainer's own sync labels its weights (current_param_version); no seam
    (
        "verl_modal/async_versions.py",
        "trainer._fit_update_weights",
    ): "no sync-label seam in verl's fully-async trainer",
    ("slime_modal/__main__.py", "args.volume"): "our parsed arguments",
    ("slime_modal/engine_job.py", "sys.argv"): "our engine job's own argv",
    ("slime_modal/engines.py", "supervisor.paused"): "our supervisor",
    # slime hands its rollout actor the parsed args (a Namespace, not a module or class); ours
    # records there the external engines it started: the forwarder ports (seam path).
    ("slime_modal/rollout_manager.py", "args.rollout_external"): "our rollout actor's args from slime",
    (
        "slime_modal/rollout_manager.py",
        "args.rollout_external_engine_addrs",
    ): "our rollout actor's args from slime",
    (
        "slime_modal/reward.py",
        "sample.remove_sample",
    ): "our reward result on slime's sample (slime reads the field)",
    # CPU mode only (slime_modal.cpu, python -m slime_modal --cpu): Megatron calls torch.cuda
    # directly, and a host without CUDA has no seam to answer those calls; never on a GPU host.
    (
        "slime_modal/cpu/cuda_on_cpu.py",
        "setattr(torch.cuda, name)",
    ): "CPU try-out: Megatron's torch.cuda calls",
    (
        "slime_modal/cpu/cuda_on_cpu.py",
        "setattr(torch.cuda.random, name)",
    ): "CPU try-out: Megatron's torch.cuda calls",
    ("slime_modal/cpu/activate.py", "spec.loader.exec_module"): "our import hook's loader on a found spec",
    # The layer spec slime's --spec asks for: a fresh ModuleSpec of Megatron's, ours to shape.
    ("slime_modal/cpu/layer_spec.py", "sub.input_layernorm"): "our layer spec",
    ("slime_modal/cpu/layer_spec.py", "sub.pre_mlp_layernorm"): "our layer spec",
    ("slime_modal/cpu/layer_spec.py", "sub.self_attention.submodules.linear_qkv"): "our layer spec",
    ("slime_modal/cpu/layer_spec.py", "sub.self_attention.submodules.core_attention"): "our layer spec",
    ("slime_modal/cpu/layer_spec.py", "sub.mlp.submodules.linear_fc1"): "our layer spec",
}
MARK = "_MARK"  # setattr(fn, _MARK, True): a wrapper marks itself so it is applied once


def _assignments() -> set[tuple[str, str]]:
    found = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr"
                    and not (
                        len(node.args) > 1 and isinstance(node.args[1], ast.Name) and node.args[1].id == MARK
                    )
                ):
                    found.add((rel, f"setattr({ast.unparse(node.args[0])}, {ast.unparse(node.args[1])})"))
                    continue
                else:
                    continue
                for target in targets:
                    if not isinstance(target, ast.Attribute):
                        continue
                    root = target.value
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id == "self":
                        continue  # an instance's own state
                    found.add((rel, ast.unparse(target)))
    return found


def test_every_remaining_swap_is_listed_with_its_reason():
    found = _assignments()
    unlisted = sorted(found - ALLOWED.keys())
    gone = sorted(ALLOWED.keys() - found)
    assert not unlisted, f"new attribute assignments (a swap needs a reason, or a seam): {unlisted}"
    assert not gone, f"listed but no longer there (drop them from ALLOWED): {gone}"


CPU_BOUNDARY = "slime_modal/cpu/"


def test_slime_modal_swaps_no_upstream_name():
    # Outside the CPU boundary (python -m slime_modal --cpu only, module docstring there).
    reasons = {
        where: why
        for where, why in ALLOWED.items()
        if where[0].startswith("slime_modal/") and not where[0].startswith(CPU_BOUNDARY)
    }
    assert reasons and all(why.startswith("our") for why in reasons.values()), reasons


def test_the_cpu_boundarys_only_upstream_swap_is_torch_cuda_on_a_host_without_it():
    upstream = {
        where
        for where, why in ALLOWED.items()
        if where[0].startswith(CPU_BOUNDARY) and not why.startswith("our")
    }
    assert upstream == {
        ("slime_modal/cpu/cuda_on_cpu.py", "setattr(torch.cuda, name)"),
        ("slime_modal/cpu/cuda_on_cpu.py", "setattr(torch.cuda.random, name)"),
    }


SEAM_PATH = "slime_modal/rollout_manager.py"


def _slime_modal_imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slime_modal"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("slime_modal"))
    return found


def _seam_path_files() -> list[Path]:
    """``SEAM_PATH`` and the slime_modal modules it imports, transitively (lazy imports too)."""
    todo, seen = [ROOT / SEAM_PATH], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _slime_modal_imports(ast.parse(path.read_text())):
            candidate = ROOT / (module.replace(".", "/") + ".py")
            if candidate.is_file():
                todo.append(candidate)
    return sorted(seen)


def _imported_names(tree: ast.AST) -> set[str]:
    """Names bound by imports of anything but the standard library (``sys.argv`` of our own
    process is not an upstream name)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] not in sys.stdlib_module_names
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] not in sys.stdlib_module_names
        ):
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def test_the_rollout_manager_seam_path_swaps_no_upstream_name():
    files = _seam_path_files()
    rels = [p.relative_to(ROOT).as_posix() for p in files]
    assert {SEAM_PATH, "slime_modal/engines.py", "slime_modal/manager_seam.py"} <= set(rels), rels
    problems = []
    for path, rel in zip(files, rels, strict=True):
        tree = ast.parse(path.read_text(), filename=rel)
        imported = _imported_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                on, name = (node.args + [None, None])[:2]
                renames = isinstance(name, ast.Constant) and name.value in ("__qualname__", "__name__")
                if renames or (isinstance(_root(on), ast.Name) and _root(on).id in imported):
                    problems.append(f"{rel}: {ast.unparse(node)}")
                continue
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue  # a local name, a subscript: nothing of another module
                root = _root(target)
                if isinstance(root, ast.Name) and root.id in imported:
                    problems.append(f"{rel}: {ast.unparse(target)} (assigns into an imported name)")
                if target.attr in ("__qualname__", "__name__"):
                    problems.append(f"{rel}: {ast.unparse(target)} (a name rewrite)")
    assert not problems, problems
    manager = next(
        n for n in ast.walk(ast.parse((ROOT / SEAM_PATH).read_text())) if isinstance(n, ast.ClassDef)
    )
    assert [ast.unparse(b) for b in manager.bases] == ["RolloutManager.__ray_actor_class__"]
