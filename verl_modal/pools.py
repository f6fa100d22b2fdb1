"""A verl ``ResourcePoolManager`` that waits for the cluster's GPUs instead of failing at once.

verl 0.9.1 checks once, right after creating its pools, that Ray's *available* GPUs cover the
pools ("Total available GPUs X is less than total desired GPUs Y"), so a job that starts
before every node has joined dies. :class:`WaitingResourcePoolManager` polls instead until
the pools fit, or raises after a timeout naming what is missing (nodes, GPUs per node).

Invariants:
- "fit" is per node, as verl places a pool: each entry of ``process_on_nodes`` (GPUs on one
  node) must go to one node with that many free GPUs; entries are packed first-fit
  decreasing over the nodes' available GPUs (pools may share a node, as colocated pools do).
  Logical GPUs (``ray start --num-gpus`` on the local backend) count like real ones.
- The wait bound is the ``wait_timeout_s`` field, default ``$VERL_MODAL_POOL_WAIT_S`` (the
  launcher sets it to the cluster's join timeout), else :data:`DEFAULT_WAIT_S`.
- Placement: with a plan in ``$VERL_MODAL_POOL_PLACEMENT`` (JSON ``{pool name: [cluster rank
  per node entry]}``, written by the launcher from :func:`placement_plan`), each node entry
  of a planned pool gets its placement group on that rank's node: verl's own bundles plus a
  sliver of the rank's custom resource ``modal_rl_rank_<r>`` (every cluster node carries
  its own). Trainer pools take the first ranks, standalone rollout replicas the ranks after.
  Pools without a plan, or whose plan does not match their node entries, are left to Ray.
- A verl whose construction sites all ask ``resource_pool_manager_class()`` (the seam of
  ``patches/verl-main/0006``, seen by :func:`verl_modal.upstream.pool_manager_class_env`)
  gets our subclass by name, :data:`MANAGER_FQN` in verl's env var, and nothing is swapped:
  the subclass is what verl builds everywhere, with or without a placement plan.
- Without that seam, :func:`install` swaps our class in for the name every verl module that
  builds a pool manager constructs (:data:`_USERS`; a test scans verl for construction sites
  and fails on a new one), in this process only; installed files are never edited. Modules
  not yet imported are swapped right after verl imports them (an import hook).
- A verl with the upstream wait (``patches/verl/0005``, seen by
  :func:`verl_modal.upstream.pool_wait_env`) needs no swap unless a placement plan is set:
  :func:`install` then only hands our wait to verl's own env var (unless already set).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from modal_rl.cluster.plan import rank_resource  # the custom resource only that rank's node has

WAIT_ENV = "VERL_MODAL_POOL_WAIT_S"
PLACEMENT_ENV = "VERL_MODAL_POOL_PLACEMENT"
DEFAULT_WAIT_S = 300.0
# What verl's resource_pool_manager_class() loads (module __getattr__ builds it on first use).
MANAGER_FQN = "verl_modal.pools.WaitingResourcePoolManager"
# Modules that construct ``ResourcePoolManager`` by the name they imported: imported and
# swapped at once (the trainer's own) ...
_USERS = (
    "verl.trainer.ppo.v1.trainer_base",
    "verl.trainer.ppo.ray_trainer",  # main_ppo_v0 imports the name from here when it runs
    "verl.workers.rollout.replica",
)
# ... and swapped when verl imports them (the separation / fully-async entry points).
_LATE_USERS = (
    "verl.experimental.separation.utils",
    "verl.experimental.fully_async_policy.fully_async_rollouter",
)


class PoolWaitTimeout(RuntimeError):
    """The cluster's GPUs did not register in time; the message says what is missing."""


def shortfall(needs: list[int], free: dict[str, float]) -> list[int]:
    """The entries of ``needs`` (GPUs wanted on one node each) that do not fit ``free``
    (node -> available GPUs), packing first-fit decreasing. Empty when everything fits."""
    room = sorted(free.values(), reverse=True)
    missing = []
    for need in sorted(needs, reverse=True):
        for i, left in enumerate(room):
            if left >= need:
                room[i] = left - need
                break
        else:
            missing.append(need)
    return missing


def available_gpus_per_node() -> dict[str, float]:
    """node id -> available GPUs (NPUs where there are no GPUs), for ALIVE nodes, as verl reads it."""
    import ray

    per_node = ray._private.state.available_resources_per_node()
    return {node: float(res.get("GPU", res.get("NPU", 0))) for node, res in per_node.items()}


def placement_plan(config, cluster_nodes: int) -> dict[str, list[int]]:
    """``{pool name: [rank per node entry]}`` for verl's pools on a ``cluster_nodes`` cluster:
    the trainer's ``global_pool`` on ranks ``0..trainer.nnodes-1`` (rank 0 runs the driver),
    each standalone rollout replica (``hybrid_engine=false``) on the ranks after, replica by
    replica as verl numbers them. Empty when the pools do not get nodes of their own (one
    node, or more pool nodes than the cluster has): then Ray places them."""
    from omegaconf import OmegaConf

    from verl_modal.preflight import standalone_pool_gpus

    trainer_nodes = int(config.trainer.nnodes)
    plan: dict[str, list[int]] = {"global_pool": list(range(trainer_nodes))}
    if standalone_pool_gpus(config):
        rollout = config.actor_rollout_ref.rollout
        nodes, per_node = int(rollout.nnodes or 0), int(rollout.n_gpus_per_node or 0)
        world = int(rollout.tensor_model_parallel_size) * int(rollout.data_parallel_size)
        world *= int(OmegaConf.select(rollout, "pipeline_model_parallel_size", default=1) or 1)
        if nodes and per_node and world:
            replicas = nodes * per_node // world
            for i in range(replicas):
                first = i * world // per_node
                span = max(1, world // per_node)
                plan[f"rollout_pool_{i}"] = [trainer_nodes + first + k for k in range(span)]
    used = {rank for ranks in plan.values() for rank in ranks}
    if cluster_nodes < 2 or max(used) >= cluster_nodes:
        return {}
    return plan


def _planned_ranks(pool: str, entries: list[int]) -> list[int] | None:
    import json

    plan = json.loads(os.environ.get(PLACEMENT_ENV) or "{}")
    ranks = plan.get(pool)
    return ranks if ranks is not None and len(ranks) == len(entries) else None


def _default_wait() -> float:
    value = os.environ.get(WAIT_ENV)
    return float(value) if value else DEFAULT_WAIT_S


def _base():
    from verl.single_controller.ray.base import ResourcePoolManager

    return ResourcePoolManager


def _make_class():
    base = _base()

    @dataclass
    class WaitingResourcePoolManager(base):
        """verl's manager; ``_check_resource_available`` waits up to ``wait_timeout_s``."""

        wait_timeout_s: float = field(default_factory=_default_wait)
        poll_s: float = 0.5

        def create_resource_pool(self):
            super().create_resource_pool()  # verl's pools, then our (waiting) availability check
            for name, pool in list(self.resource_pool_dict.items()):
                ranks = _planned_ranks(name, list(self.resource_pool_spec[name]))
                if ranks is not None:
                    self.resource_pool_dict[name] = placed_pool(pool, ranks)

        def required(self) -> list[int]:
            return [n for nodes in self.resource_pool_spec.values() for n in nodes if n > 0]

        def _check_resource_available(self):
            needs = self.required()
            deadline = time.monotonic() + self.wait_timeout_s
            started = time.monotonic()
            said = False
            while True:
                free = available_gpus_per_node()
                missing = shortfall(needs, free)
                if not missing:
                    if said:
                        print(f"[verl_modal.pools] GPUs ready after {time.monotonic() - started:.1f} s")
                    return
                if time.monotonic() >= deadline:
                    raise PoolWaitTimeout(self.describe_missing(needs, free, missing))
                if not said:
                    print(f"[verl_modal.pools] waiting up to {self.wait_timeout_s:g} s: {self.status(free)}")
                    said = True
                time.sleep(self.poll_s)

        def status(self, free: dict[str, float]) -> str:
            have = ", ".join(f"{node[:8]}: {gpus:g}" for node, gpus in sorted(free.items())) or "none"
            return f"pools {dict(self.resource_pool_spec)} need {sum(self.required())} GPUs; free per node: {have}"

        def describe_missing(self, needs: list[int], free: dict[str, float], missing: list[int]) -> str:
            counts: dict[int, int] = {}
            for n in missing:
                counts[n] = counts.get(n, 0) + 1
            what = ", ".join(f"{c} node(s) with {n} free GPU(s)" for n, c in sorted(counts.items()))
            return (
                f"after {self.wait_timeout_s:g} s the Ray cluster still lacks {what} for verl's resource pools "
                f"({len(needs)} node slot(s), {sum(needs)} GPUs in all; {len(free)} node(s) registered with "
                f"{sum(free.values()):g} free GPUs); {self.status(free)}"
            )

    return WaitingResourcePoolManager


def placed_pool(pool, ranks: list[int]):
    """``pool`` (a verl ``RayResourcePool``) whose i-th node entry is placed on rank ``ranks[i]``."""
    from verl.single_controller.ray.base import RayResourcePool

    class PlacedResourcePool(RayResourcePool):
        """One placement group per node entry, each built by verl's own code with the entry's
        rank resource as its ``accelerator_type``; kept in rank order."""

        def get_placement_groups(self, strategy="STRICT_PACK", name=None, device_name="cuda"):
            if self.pgs is None:
                groups = []
                for i, (count, rank) in enumerate(zip(self._store, ranks, strict=True)):
                    one = RayResourcePool(
                        [count],
                        use_gpu=self.use_gpu,
                        name_prefix=f"{self.name_prefix}_rank{rank}_",
                        max_colocate_count=self.max_colocate_count,
                        detached=self.detached,
                        accelerator_type=rank_resource(rank),
                    )
                    groups += one.get_placement_groups(
                        strategy, name=name and f"{name}{i}_", device_name=device_name
                    )
                self.pgs = groups
            return self.pgs

    placed = PlacedResourcePool(
        list(pool._store),
        use_gpu=pool.use_gpu,
        name_prefix=pool.name_prefix,
        max_colocate_count=pool.max_colocate_count,
        detached=pool.detached,
    )
    placed.ranks = list(ranks)
    return placed


_CLASS = None


def manager_class():
    """Our ``ResourcePoolManager`` subclass (built on first use: it imports verl)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_class()
    return _CLASS


def __getattr__(name: str):
    # verl loads MANAGER_FQN by name; building the class imports verl, so it waits until asked.
    if name == "WaitingResourcePoolManager":
        return manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _swap(module) -> bool:
    if getattr(module, "ResourcePoolManager", None) is None:
        return False
    module.ResourcePoolManager = manager_class()
    return True


def install() -> list[str]:
    """Make every place verl builds a pool manager build ours; returns the modules changed now
    (the late ones are changed when imported). On a verl with the pool-manager seam: no swap,
    verl's env var names our class, returns ``[]``. On a verl with the upstream wait and no
    placement plan: no swap, verl's env var gets our wait, returns ``[]``."""
    import importlib
    import sys

    from verl_modal import _register, upstream

    seam_env = upstream.pool_manager_class_env()
    if seam_env:
        named = os.environ.setdefault(seam_env, MANAGER_FQN)
        if named != MANAGER_FQN:
            print(f"[verl_modal.pools] ${seam_env}={named} is set: verl builds that, not our manager")
        return []
    verl_env = upstream.pool_wait_env()
    if verl_env and not os.environ.get(PLACEMENT_ENV):
        os.environ.setdefault(verl_env, f"{_default_wait():g}")
        return []
    changed = []
    for name in _USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if _swap(module):
            changed.append(name)
    for name in _LATE_USERS:
        if name in sys.modules:
            if _swap(sys.modules[name]):
                changed.append(name)
        else:
            _register.after_import(
                name, _register.loudly(f"the pool manager of {name}", lambda n=name: _swap(sys.modules[n]))
            )
    return changed
