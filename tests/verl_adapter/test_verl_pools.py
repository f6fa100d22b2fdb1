"""verl_modal.pools against a real local Ray cluster on loopback (127.0.0.2, as the local
backend uses it): GPUs that register late are waited for, GPUs that never do produce a
timeout naming them, and stock verl fails at once in the same state (so the test can fail).

The Ray nodes are ``ray start --block`` children tagged with a run id; teardown ends exactly
those processes (``modal_rl.cluster.procs.end_run``), never ``ray stop``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests._local_ray import LocalRay
from verl_modal.pools import PoolWaitTimeout, shortfall

ADDRESS = "127.0.0.2"


def test_shortfall_packs_per_node_first_fit_decreasing():
    assert shortfall([1, 1], {"a": 1, "b": 1}) == []
    assert shortfall([1, 1], {"a": 2}) == []  # two entries may share a node
    assert shortfall([2], {"a": 1, "b": 1}) == [2]  # one entry never spans nodes
    assert shortfall([8, 8], {"a": 8, "b": 0}) == [8]
    assert shortfall([4, 2, 2], {"a": 4, "b": 4}) == []
    assert shortfall([1], {}) == [1]


def test_install_swaps_the_class_verl_constructs():
    from verl_modal import pools

    changed = pools.install()
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    import verl.workers.rollout.replica as replica
    from verl.single_controller.ray.base import ResourcePoolManager

    assert "verl.trainer.ppo.v1.trainer_base" in changed
    assert trainer_base.ResourcePoolManager is pools.manager_class()
    assert replica.ResourcePoolManager is pools.manager_class()
    assert issubclass(pools.manager_class(), ResourcePoolManager)


def test_with_verls_pool_manager_seam_install_names_ours_and_swaps_nothing(monkeypatch):
    """The seam path (``patches/verl/0008``; the detector is tested on source in
    test_verl_upstream_detect.py, the whole path on the patched sdist in
    test_patches_seams.py): our class reaches verl by name, through verl's own loader."""
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.single_controller.ray.base import ResourcePoolManager
    from verl.utils.import_utils import load_class_from_fqn

    from verl_modal import pools, upstream

    env = "VERL_RESOURCE_POOL_MANAGER_CLASS"
    monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(upstream, "pool_manager_class_env", lambda: env)
    before = trainer_base.ResourcePoolManager
    assert pools.install() == []
    assert trainer_base.ResourcePoolManager is before  # nothing swapped on this path
    assert os.environ[env] == pools.MANAGER_FQN
    loaded = load_class_from_fqn(os.environ[env], description="resource pool manager class")
    assert loaded is pools.manager_class() and issubclass(loaded, ResourcePoolManager)
    monkeypatch.setenv(env, "someone.elses.Manager")  # a deployment's own choice is kept
    assert pools.install() == [] and os.environ[env] == "someone.elses.Manager"


def test_wait_default_comes_from_the_env(monkeypatch):
    from verl_modal import pools

    monkeypatch.setenv(pools.WAIT_ENV, "42")
    assert pools.manager_class()(resource_pool_spec={"p": [1]}, mapping={}).wait_timeout_s == 42.0


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    """A head with 0 GPUs and a driver attached to it; followers are added by the tests."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    local = LocalRay(ADDRESS)
    try:
        local.start_node(gpus=0, cpus=1, head=True)
        local.wait_for_gcs()
        ray.init(address=f"{ADDRESS}:{local.gcs_port}", _node_ip_address=ADDRESS, log_to_driver=False)
        addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert addresses == {ADDRESS}, addresses  # nothing off loopback
        yield local
    finally:
        ray.shutdown()
        assert local.close() == []


def _manager(spec, wait_s):
    from verl_modal.pools import manager_class

    return manager_class()(resource_pool_spec=spec, mapping={}, wait_timeout_s=wait_s, poll_s=0.2)


def test_gpus_that_never_register_time_out_naming_what_is_missing(cluster):
    manager = _manager({"global_pool": [1, 1]}, wait_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(PoolWaitTimeout) as err:
        manager.create_resource_pool()
    elapsed = time.monotonic() - t0
    assert 2.0 <= elapsed < 10.0
    message = str(err.value)
    assert "lacks 2 node(s) with 1 free GPU(s)" in message
    assert "1 node(s) registered with 0 free GPUs" in message


def test_gpus_that_register_late_are_waited_for_and_usable(cluster):
    import ray
    from verl.single_controller.ray.base import ResourcePoolManager

    spec = {"global_pool": [1, 1]}
    # Stock verl in the same state: fails at once (this is what we replace).
    with pytest.raises(ValueError, match="Total available GPUs 0"):
        ResourcePoolManager(resource_pool_spec=spec, mapping={}).create_resource_pool()

    delay = 2.0
    started: list[subprocess.Popen] = []
    # logical GPUs, as the local backend declares them; the node is only started after `delay`
    timer = threading.Timer(delay, lambda: started.append(cluster.start_node(gpus=2, cpus=8)))
    manager = _manager(spec, wait_s=120.0)
    t0 = time.monotonic()
    timer.start()
    manager.create_resource_pool()
    elapsed = time.monotonic() - t0
    timer.join()
    assert started and started[0].poll() is None
    assert elapsed >= delay
    assert ray.available_resources().get("GPU") == 2.0
    # The pools verl builds on top are placeable: one placement group per node entry, each
    # with one GPU bundle, both on the late node (the head has none).
    pgs = manager.resource_pool_dict["global_pool"].get_placement_groups()
    assert [pg.bundle_count for pg in pgs] == [1, 1]
    ray.get([pg.ready() for pg in pgs], timeout=60)
    # Ray's resource view is eventually consistent: the reservation shows up a moment later.
    _wait_for(lambda: ray.available_resources().get("GPU", 0.0) == 0.0, 30, "both GPUs to be reserved")
    for pg in pgs:
        ray.util.remove_placement_group(pg)


def test_planned_pools_land_on_their_ranks(cluster, monkeypatch):
    import ray

    from verl_modal.pools import PLACEMENT_ENV, rank_resource

    # Two cluster ranks with one GPU each (the earlier test's untagged 2-GPU node is free too,
    # so Ray alone could put both pools there). Plan: trainer on rank 2, replica on rank 1.
    for rank in (1, 2):
        cluster.start_node(gpus=1, cpus=8, resources={rank_resource(rank): 1})
    _wait_for(
        lambda: all(ray.cluster_resources().get(rank_resource(r)) for r in (1, 2)), 90, "the ranked nodes"
    )
    monkeypatch.setenv(PLACEMENT_ENV, json.dumps({"global_pool": [2], "rollout_pool_0": [1]}))
    node_of_rank = {
        r: next(n["NodeID"] for n in ray.nodes() if n["Alive"] and rank_resource(r) in n["Resources"])
        for r in (1, 2)
    }
    pools = {}
    for name in ("global_pool", "rollout_pool_0"):
        manager = _manager({name: [1]}, wait_s=60.0)
        manager.create_resource_pool()
        pools[name] = manager.resource_pool_dict[name]
    try:
        for name, rank in (("global_pool", 2), ("rollout_pool_0", 1)):
            (pg,) = pools[name].get_placement_groups()
            bundles = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            assert set(bundles.values()) == {node_of_rank[rank]}, (name, bundles)
    finally:
        for pool in pools.values():
            for pg in pool.pgs or []:
                ray.util.remove_placement_group(pg)


# --- every place verl builds a pool manager gets ours (installed, unpatched verl 0.9.1) ---

# (module with the call, module whose ``ResourcePoolManager`` name the call resolves)
VERL_091_SITES = {
    ("verl.trainer.main_ppo_v0", "verl.trainer.ppo.ray_trainer"),
    ("verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.v1.trainer_base"),
    ("verl.workers.rollout.replica", "verl.workers.rollout.replica"),
    ("verl.experimental.separation.utils", "verl.experimental.separation.utils"),
    (
        "verl.experimental.fully_async_policy.fully_async_rollouter",
        "verl.experimental.fully_async_policy.fully_async_rollouter",
    ),
}


def _construction_sites() -> set[tuple[str, str]]:
    """Every ``ResourcePoolManager(...)`` call in the installed verl, with the module its name
    is bound in: a function-local ``from X import ResourcePoolManager`` binds X, else the module."""
    import ast
    from pathlib import Path

    import verl

    root = Path(verl.__file__).parent
    sites = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ResourcePoolManager"):
                continue
            binding = module
            for func in functions:
                if node in set(ast.walk(func)):
                    for imp in ast.walk(func):
                        if isinstance(imp, ast.ImportFrom) and any(
                            a.name == "ResourcePoolManager" for a in imp.names
                        ):
                            binding = imp.module
            sites.add((module, binding))
    return sites


def test_the_installed_verl_is_unpatched():
    from verl_modal import upstream

    assert upstream.seams() == dict.fromkeys(upstream.seams(), False)  # else the tests below prove less


_SWAP_CHECK = """
import importlib, json, sys
sites = json.loads(sys.argv[1])
if sys.argv[2] == "imported-first":
    for _, binding in sites:
        importlib.import_module(binding)
from verl_modal import pools
pools.install()
print(json.dumps({b: importlib.import_module(b).ResourcePoolManager is pools.manager_class() for _, b in sites}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["imported-first", "installed-first"])
def test_install_reaches_every_place_verl_builds_the_pool_manager(order):
    """In a fresh process, whether verl's modules are imported before ``install`` (swapped at
    once) or after (swapped by the import hook), every construction site resolves to ours."""
    sites = _construction_sites()
    assert sites == VERL_091_SITES, "verl builds its pool manager somewhere new: extend pools._USERS"
    proc = subprocess.run(
        [sys.executable, "-c", _SWAP_CHECK, json.dumps(sorted(sites)), order],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    swapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert swapped == dict.fromkeys(swapped, True) and len(swapped) == len(sites), swapped


class _Built(Exception):
    """Raised by the stubbed ``create_resource_pool``: carries the manager verl built."""


@pytest.fixture
def stop_at_create(monkeypatch):
    from verl_modal import pools

    def create_resource_pool(self):
        raise _Built(self)

    pools.install()
    monkeypatch.setattr(pools.manager_class(), "create_resource_pool", create_resource_pool)
    return pools.manager_class()


def test_separation_utils_builds_ours(stop_at_create):
    from omegaconf import OmegaConf
    from verl.experimental.separation.utils import create_resource_pool_manager
    from verl.trainer.ppo.utils import Role

    config = OmegaConf.create({"trainer": {"n_gpus_per_node": 2, "nnodes": 1}})
    manager = create_resource_pool_manager(config, roles=[Role.ActorRollout])
    assert type(manager) is stop_at_create
    assert manager.resource_pool_spec == {"trainer_pool": [2]}


def test_fully_async_rollouter_builds_ours(stop_at_create):
    import asyncio

    from omegaconf import OmegaConf
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter

    rollouter = object.__new__(FullyAsyncRollouter.__ray_actor_class__)  # the actor's class, no actor
    rollouter.config = OmegaConf.create(
        {"distillation": {"enabled": True, "n_gpus_per_node": 1, "nnodes": 2}}
    )
    with pytest.raises(_Built) as built:
        asyncio.run(rollouter._create_teacher_model_manager())
    (manager,) = built.value.args
    assert type(manager) is stop_at_create
    assert manager.resource_pool_spec == {"teacher_pool": [1, 1]}
