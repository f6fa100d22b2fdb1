"""verl preflight: everything about a verl command line that can be checked before anything
is provisioned, in one process, in seconds.

Order (the first failure is the one reported, as one line):
1. every override is ``key=value`` Hydra syntax;
2. ``trainer.n_gpus_per_node`` agrees with the cluster; ``trainer.nnodes`` is the line's, or
   filled in around its other pools (:func:`cluster_overrides`); pools that overflow the cluster
   or leave nodes idle are an error naming the node count that fits;
3. Hydra composes verl's own ``ppo_trainer`` with the overrides (an unknown key or bad value
   is Hydra's error; ``+key``/``++key`` add keys on purpose, as with verl's own entry);
4. the caller's checks (inputs that must exist), then a group-relative advantage estimator
   (GRPO, RLOO, ...) draws at least two samples per prompt (``rollout.n``: under our group rule a
   lone sample's advantage is 0), then the GPUs the config asks for fit the cluster;
5. verl's own ``validate_config`` (batch sizes, parallelism, strategy).

Steps 1-4 need no verl import and fail in about a second; step 5 imports verl (torch and
tensordict: 8-10 s on a 2-core machine), so it runs last.

Invariant: nothing here starts Ray, a process or a container; importing this is cheap.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass


class VerlPreflightError(ValueError):
    """A verl command line that cannot run on the cluster; the message is one line."""


@dataclass(frozen=True)
class ClusterShape:
    """What verl sees of a cluster: nodes and (possibly logical) GPUs per node."""

    nodes: int
    gpus_per_node: int
    flag_hint: str = "--nodes/--gpu"
    # A single local node started for this run declares as many logical GPUs as the config's
    # pools ask for (``runner.logical_gpus``), so its GPU count cannot fall short.
    declares_what_is_asked: bool = False


NNODES = "trainer.nnodes"
NGPUS = "trainer.n_gpus_per_node"


def explicit_values(overrides: list[str]) -> dict[str, str]:
    """``key -> value`` of the last override for each key (``+``/``++`` prefixes dropped)."""
    from verl_modal.cpu.overrides import OverrideError, override_key

    values: dict[str, str] = {}
    for override in overrides:
        try:
            key = override_key(override)
        except OverrideError as exc:
            raise VerlPreflightError(str(exc)) from None
        values[key] = override.partition("=")[2]
    return values


STANDALONE = "actor_rollout_ref.hybrid_engine"
ROLLOUT_NODES = "actor_rollout_ref.rollout.nnodes"
ROLLOUT_NAME = "actor_rollout_ref.rollout.name"
# Rollout replicas that bring GPUs of their own (Modal containers; ``verl_modal.replica``):
# their pool takes nothing from the trainer's cluster.
OFF_CLUSTER_ROLLOUTS = ("modal_vllm",)


def standalone_rollout_nodes(given: dict[str, str]) -> int:
    """Cluster nodes the user gives verl's standalone rollout pool (``hybrid_engine=false``
    with replicas that run on the cluster), else 0."""
    if given.get(STANDALONE, "true").strip().lower() not in ("false", "0"):
        return 0
    if given.get(ROLLOUT_NAME) in OFF_CLUSTER_ROLLOUTS:
        return 0
    value = given.get(ROLLOUT_NODES, "0")
    try:
        return int(value)
    except ValueError:
        raise VerlPreflightError(f"{ROLLOUT_NODES}={value!r} is not an integer") from None


# Pools other than the trainer's that take nodes of their own when enabled: (name, switch key,
# switch default, nodes key, GPUs-per-node key), as verl's ``_init_resource_pool_mgr`` builds them.
SEPARATE_POOLS = (
    ("teacher", "distillation.enabled", "false", "distillation.nnodes", "distillation.n_gpus_per_node"),
    (
        "reward",
        "reward.reward_model.enable_resource_pool",
        "false",
        "reward.reward_model.nnodes",
        "reward.reward_model.n_gpus_per_node",
    ),
)


def _int(given: dict[str, str], key: str, default: int = 0) -> int:
    value = given.get(key)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise VerlPreflightError(f"{key}={value!r} is not an integer") from None


def declared_pool_nodes(given: dict[str, str]) -> list[tuple[str, int]]:
    """``(pool, nodes)`` of the pools besides the trainer's that the user's line declares:
    standalone rollout replicas, a distillation teacher, a reward model's own pool."""
    pools = [("rollout", standalone_rollout_nodes(given))]
    for name, switch, default, nodes_key, _ in SEPARATE_POOLS:
        if given.get(switch, default).strip().lower() in ("true", "1"):
            pools.append((name, _int(given, nodes_key)))
    return [(name, n) for name, n in pools if n > 0]


def cluster_overrides(shape: ClusterShape, user: list[str]) -> list[str]:
    """``trainer.nnodes`` and ``trainer.n_gpus_per_node`` for the cluster, to go *before* the
    user's overrides.

    ``trainer.nnodes`` as the line gives it is kept; absent, the trainer gets the nodes the
    line's other pools (standalone rollout replicas, a teacher, a reward model pool) leave, or
    every node of a cluster too small to give them their own (a single local node with
    logical GPUs). A line whose pools need more nodes than the cluster has, or leave nodes
    idle, is refused with the node count that fits. ``trainer.n_gpus_per_node`` must be the
    cluster's GPUs per node (absent: filled in)."""
    given = explicit_values(user)
    others = declared_pool_nodes(given)
    other_nodes = sum(n for _, n in others)
    separate = shape.nodes > other_nodes > 0
    trainer_nodes = shape.nodes - other_nodes if separate else shape.nodes
    if NGPUS in given:
        got = _int(given, NGPUS)
        if got != shape.gpus_per_node:
            raise VerlPreflightError(
                f"{NGPUS}={got} disagrees with the cluster ({shape.nodes} nodes x {shape.gpus_per_node} "
                f"GPUs); the cluster has {shape.gpus_per_node} GPUs per node: drop {NGPUS} or change "
                f"{shape.flag_hint}"
            )
    if NNODES in given:
        trainer_nodes = _int(given, NNODES)
        if trainer_nodes < 1:
            raise VerlPreflightError(f"{NNODES}={trainer_nodes}: the trainer needs at least one node")
        need = trainer_nodes + other_nodes
        pools = ", ".join(f"{name} {n}" for name, n in [("trainer", trainer_nodes), *others])
        if trainer_nodes > shape.nodes or not shape.declares_what_is_asked:
            if need > shape.nodes and (other_nodes == 0 or separate or trainer_nodes > shape.nodes):
                raise VerlPreflightError(
                    f"{NNODES}={trainer_nodes} does not fit: the line's pools need {need} nodes ({pools}) "
                    f"and the cluster has {shape.nodes}; use --nodes {need}, or drop {NNODES}"
                )
            if need < shape.nodes and not shape.declares_what_is_asked:
                raise VerlPreflightError(
                    f"the line's pools fill {need} of the cluster's {shape.nodes} nodes ({pools}); use "
                    f"--nodes {need}, or drop {NNODES} to give the trainer the rest"
                )
    return [f"{NNODES}={trainer_nodes}", f"{NGPUS}={shape.gpus_per_node}"]


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def verl_config_dir() -> str:
    """verl's Hydra config directory, found without importing verl (seconds of torch)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise VerlPreflightError(
            "verl is not installed here (preflight composes verl's own config); "
            "install it with: pip install 'modal-rl[verl]'"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config")


# The config a line composes (``entry.parse``: ``--config-path/--config-name`` or its main's
# default); ``None`` dir: verl's own trainer configs.
_SELECTED: dict[str, str | None] = {"name": "ppo_trainer", "dir": None}

# Keys verl's configs no longer have, and what to do instead of adding them back with +key.
REMOVED_KEYS = {
    "megatron.grad_offload": "verl 0.9.1 removed it (param_offload and optimizer_offload remain); drop it",
}


SEARCHPATH = "hydra.searchpath"
# verl's one-step-off config extends ppo_trainer through a search path relative to the working
# directory (file://verl/trainer/config: a verl checkout's root); the package names it anywhere.
VERL_SEARCHPATH = "pkg://verl.trainer.config"
_RELATIVE_SEARCHPATH = re.compile(r"^\s*-\s*file://(?!/)", re.M)


def searchpath_overrides(config_dir: str | None, config_name: str, overrides: list[str]) -> list[str]:
    """What a config whose yaml searches a relative ``file://`` path needs to find the configs
    it extends from any working directory, unless the line sets ``hydra.searchpath`` itself."""
    if not config_dir or any(o.partition("=")[0].lstrip("+") == SEARCHPATH for o in overrides):
        return []
    try:
        with open(os.path.join(config_dir, config_name + ".yaml"), encoding="utf-8") as f:
            relative = bool(_RELATIVE_SEARCHPATH.search(f.read()))
    except OSError:
        return []
    return [f"{SEARCHPATH}=[{VERL_SEARCHPATH}]"] if relative else []


def select_config(name: str = "ppo_trainer", directory: str | None = None) -> None:
    """The config :func:`compose` uses from now on in this process."""
    _SELECTED.update(name=name, dir=directory)


def compose(overrides: list[str], config_name: str | None = None):
    """verl's config (``ppo_trainer``, or the one :func:`select_config` chose) with
    ``overrides``; Hydra's errors as one-line preflight errors (an unknown key is named as
    such, with the ``+key=`` form that adds one on purpose, or the fix for a removed key)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    config_name = config_name or _SELECTED["name"]
    overrides = list(overrides) + searchpath_overrides(_SELECTED["dir"], config_name, overrides)
    try:
        with initialize_config_dir(config_dir=_SELECTED["dir"] or verl_config_dir(), version_base=None):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigAttributeError | ConfigKeyError) and "not in struct" in str(cause):
            key = getattr(cause, "full_key", None) or "?"
            removed = next(
                (why for k, why in REMOVED_KEYS.items() if key == k or key.endswith("." + k)), None
            )
            if removed:
                raise VerlPreflightError(f"unknown key {key}: {removed}") from None
            raise VerlPreflightError(
                f"unknown key {key}: verl's {config_name} config has no such key "
                f"(to add a new key on purpose, write +{key}=...)"
            ) from None
        raise VerlPreflightError(one_line(exc)) from None


def validate(config) -> None:
    """verl's own checks, as ``verl.trainer.main_ppo.main`` runs them before ``run_ppo``."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    config = offline_view(config)
    try:
        # verl prints its verdict ("All configuration checks passed"); stdout is for our plan and
        # a failure raises, so the verdict is dropped.
        with contextlib.redirect_stdout(io.StringIO()):
            auto_set_device(config)
            validate_config(
                config=config,
                use_reference_policy=need_reference_policy(config),
                use_critic=need_critic(config),
            )
    except Exception as exc:  # verl raises assorted types; all mean "this config is invalid"
        raise VerlPreflightError(f"verl rejected the config: {one_line(exc)}") from None


def offline_view(config):
    """``config`` as verl's validation may read it without the network: verl builds the critic's
    config object, whose model part loads the model's config and tokenizer (from the Hub, or
    a path that may be on a Volume); the checks read nothing of it, so the view has none."""
    import copy

    from omegaconf import OmegaConf, open_dict

    if OmegaConf.select(config, "critic.model", default=None) is None:
        return config
    view = copy.deepcopy(config)
    with open_dict(view.critic):
        view.critic.model = None
    return view


def required_gpus(config) -> int:
    """GPUs verl's resource pools ask for: ``nnodes x n_gpus_per_node`` plus the separate reward
    and teacher pools when enabled (as ``_init_resource_pool_mgr`` builds them), plus the
    standalone rollout replicas' pool when ``hybrid_engine=false``."""
    from omegaconf import OmegaConf

    total = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node) + standalone_pool_gpus(config)
    pools = {"reward.reward_model": "enable_resource_pool", "distillation": "enabled"}
    for pool, flag in pools.items():
        if OmegaConf.select(config, f"{pool}.{flag}", default=False):
            nodes = OmegaConf.select(config, f"{pool}.nnodes", default=0) or 0
            per = OmegaConf.select(config, f"{pool}.n_gpus_per_node", default=0) or 0
            total += int(nodes) * int(per)
    return total


# ``???`` values verl's config leaves unset unless the part is enabled (a reward model's rollout).
_MANDATORY_ONLY_WHEN_USED = ("reward.reward_model.",)


def check_mandatory(config) -> None:
    """verl's config marks values every run needs as ``???``; verl itself only notices one when
    a worker reads it, minutes into the run. Name them now."""
    from omegaconf import OmegaConf

    missing = [
        k for k in sorted(OmegaConf.missing_keys(config)) if not k.startswith(_MANDATORY_ONLY_WHEN_USED)
    ]
    if missing:
        raise VerlPreflightError(f"verl needs a value for {', '.join(missing)} (e.g. {missing[0]}=...)")


def standalone_pool_gpus(config) -> int:
    """GPUs of the standalone rollout replicas' pool on the cluster: ``rollout.nnodes x
    rollout.n_gpus_per_node`` with ``hybrid_engine=false``, unless the replicas bring their own."""
    from omegaconf import OmegaConf

    if OmegaConf.select(config, STANDALONE, default=True):
        return 0
    # select, not attribute access: a missing mandatory value is verl's validation to report
    if OmegaConf.select(config, ROLLOUT_NAME, default=None) in OFF_CLUSTER_ROLLOUTS:
        return 0
    nodes_key, per_key = rollout_pool_keys(config)
    nodes = OmegaConf.select(config, nodes_key, default=0) or 0
    return int(nodes) * int(OmegaConf.select(config, per_key, default=0) or 0)


def rollout_pool_keys(config) -> tuple[str, str]:
    """The keys that size the standalone rollout pool: a config with a top-level ``rollout``
    section (verl's one-step-off and fully-async mains) has its main copy ``rollout.nnodes``
    and ``rollout.n_gpus_per_node`` over ``actor_rollout_ref.rollout``'s before it runs."""
    if "rollout" in config and "nnodes" in config.rollout:
        return "rollout.nnodes", "rollout.n_gpus_per_node"
    return ROLLOUT_NODES, "actor_rollout_ref.rollout.n_gpus_per_node"


def check_off_cluster_weights(config) -> None:
    """``modal_vllm`` policy engines take updates only from a checkpoint engine their CPU relay
    worker can run (``replica_weights``); the replica refuses the rest too, but only once the
    cluster is up."""
    from omegaconf import OmegaConf

    from verl_modal.replica_weights import checkpoint_engine_problem

    if OmegaConf.select(config, ROLLOUT_NAME, default=None) not in OFF_CLUSTER_ROLLOUTS:
        return
    backend = OmegaConf.select(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", default=None)
    problem = checkpoint_engine_problem(backend)
    if problem:
        raise VerlPreflightError(problem)


def check_group_size(config) -> None:
    """A group-relative estimator with one sample per prompt has no baseline: under the group
    rule (``verl_modal.group_advantage``) every advantage would be 0 and the run would learn
    nothing (verl alone would train on raw scores)."""
    from omegaconf import OmegaConf

    from verl_modal.group_advantage import GROUPED

    estimator = str(OmegaConf.select(config, "algorithm.adv_estimator", default=""))
    n = OmegaConf.select(config, "actor_rollout_ref.rollout.n", default=1)
    if estimator in GROUPED and isinstance(n, int) and n < 2:
        raise VerlPreflightError(
            f"algorithm.adv_estimator={estimator} compares each sample with the others of its prompt, "
            f"and actor_rollout_ref.rollout.n={n} draws one: every advantage would be 0; set "
            "actor_rollout_ref.rollout.n=2 or more"
        )


def pools_of(config) -> list[tuple[str, int, int]]:
    """``(pool, nodes, GPUs per node)`` of every pool the composed config asks the cluster for."""
    from omegaconf import OmegaConf

    pools = [("trainer", int(config.trainer.nnodes), int(config.trainer.n_gpus_per_node))]
    if standalone_pool_gpus(config):
        nodes_key, per_key = rollout_pool_keys(config)
        pools.append(
            (
                "rollout",
                int(OmegaConf.select(config, nodes_key, default=0) or 0),
                int(OmegaConf.select(config, per_key, default=0) or 0),
            )
        )
    for name, switch, _, nodes_key, per_key in SEPARATE_POOLS:
        if OmegaConf.select(config, switch, default=False):
            pools.append(
                (
                    name,
                    int(OmegaConf.select(config, nodes_key, default=0) or 0),
                    int(OmegaConf.select(config, per_key, default=0) or 0),
                )
            )
    return [p for p in pools if p[1] and p[2]]


def check_gpus(config, shape: ClusterShape) -> None:
    want = required_gpus(config)
    # A logical local node declares exactly what the pools ask for, so only TP can exceed it.
    have = want if shape.declares_what_is_asked else shape.nodes * shape.gpus_per_node
    pools = pools_of(config)
    listed = " + ".join(f"{name} {nodes} x {per}" for name, nodes, per in pools)
    if not shape.declares_what_is_asked:
        for name, _, per in pools:
            if per > shape.gpus_per_node:
                raise VerlPreflightError(
                    f"the {name} pool asks for {per} GPUs per node but the cluster's nodes have "
                    f"{shape.gpus_per_node}; change {shape.flag_hint} or the {name} pool's n_gpus_per_node"
                )
    from modal_rl.cluster.placement import nodes_needed

    need = nodes_needed([(per, nodes) for _, nodes, per in pools], shape.gpus_per_node)
    if want > have or (not shape.declares_what_is_asked and need is not None and need > shape.nodes):
        fix = f"use --nodes {need}" if need else f"change {shape.flag_hint}"
        raise VerlPreflightError(
            f"the config asks for {want} GPUs ({listed}) but the cluster has {shape.nodes} nodes x "
            f"{shape.gpus_per_node} = {have}; {fix}, or shrink the pools"
        )
    from omegaconf import OmegaConf

    tp = int(OmegaConf.select(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", default=1) or 1)
    if tp > have and shape.declares_what_is_asked:
        raise VerlPreflightError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} exceeds the {have} logical GPU(s) "
            f"the config asks for on this local node; lower it, or raise {NGPUS} to at least {tp}"
        )
    if tp > have:
        raise VerlPreflightError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} exceeds the cluster's {have} GPUs"
        )


def preflight(shape: ClusterShape, overrides: list[str], checks=(), verl_checks: bool = True):
    """Compose, size-check and validate ``overrides`` (already aligned with the cluster);
    ``checks`` (each ``config -> None``, raising) run right after composition. Returns the composed config. Raises :class:`VerlPreflightError` (one line),
    or whatever a check raises."""
    explicit_values(overrides)  # syntax first: a malformed override is named as such
    config = compose(overrides)
    check_mandatory(config)
    check_off_cluster_weights(config)
    for check in checks:
        check(config)
    check_group_size(config)
    check_gpus(config, shape)  # before verl is imported: a wrong size fails in about a second
    if verl_checks:  # main_ppo's own checks; verl's other mains run checks of their own
        validate(config)
    return config
