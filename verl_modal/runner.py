"""Runs verl's PPO entry unchanged on a Ray cluster we bring up: ``run_ppo(config,
task_runner_class=...)`` with a TaskRunner subclass that installs our CPU pieces.

Invariants:
- The process env (:func:`prepare_process_env`) is set before anything imports verl: verl
  resolves its platform at import time (``verl.trainer.constants_ppo``).
- Bring-up is one function, ``bring_up(config, env_vars)``, that leaves ``ray`` initialised;
  :func:`start_local_ray` is the one-node local one (the cluster layer swaps in its own).
  Every env var our pieces need is passed in the job's runtime env explicitly, because verl's
  ``get_ppo_ray_runtime_env`` drops keys the driver already has set, assuming workers inherit
  the driver's env, which is not true on a cluster started elsewhere.
- The local Ray node is advertised and reached at 127.0.0.1 (no traffic leaves loopback);
  :func:`start_local_ray` checks `ray.nodes()`.
- A main whose TaskRunner builds Ray actors of its own by a module-level name (verl's
  fully-async trainer and rollouter, :data:`MAIN_ACTORS`) gets ours in their place, in the
  TaskRunner's process only: subclasses that run our setup in the actor's process first.
- Only the Ray instance this process started is shut down, by ``ray.shutdown()``.
- A run owns a temp dir (``modal_rl.run_temp.process_temp``): this process's ``TMPDIR`` for
  the run, so the local Ray (its session dir), its workers and the vLLM servers they start
  write their temp files there; it is removed after ``ray.shutdown()``, however the run ends.
"""

from __future__ import annotations

import os
from collections.abc import Callable

LOOPBACK = "127.0.0.1"
# Ray resolves 127.0.0.1 to the host's routable address unless it believes it runs
# single-node (its Windows/macOS mode); read by ``ray`` at import, so set before that. The
# in-process Ray is loopback-only and keeps token auth off (else ``ray.init`` would write
# ~/.ray/auth_token); a cluster's mode comes from its plan (``modal_rl.cluster``).
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
OBJECT_STORE_BYTES = 1 << 30  # verl's batches here are KiB; Ray's default is 30% of RAM


def prepare_process_env(env: dict[str, str], *, local: bool = True) -> None:
    """Put ``env`` (and, for the one-node local Ray, :data:`LOCAL_RAY_ENV`) into this process
    before verl or Ray is imported. On a cluster the bootstrap has set the node's env, Ray's
    auth mode included (token on Modal): a driver that overrode it could not attach."""
    if local:
        os.environ.update(LOCAL_RAY_ENV)
    os.environ.update(env)


def runtime_env_for(config, env_vars: dict[str, str], *, local: bool = True) -> dict:
    """verl's default PPO runtime env, the user's ``ray_kwargs.ray_init.runtime_env``, and
    ``env_vars`` (ours win), as ``run_ppo`` would build it plus our explicit env."""
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    runtime_env = get_ppo_ray_runtime_env(config)
    if config.transfer_queue.enable:
        runtime_env["env_vars"]["TRANSFER_QUEUE_ENABLE"] = "1"
    user = OmegaConf.to_container(config.ray_kwargs.get("ray_init", {}).get("runtime_env", {}) or {})
    user = {k: v for k, v in user.items() if v is not None}
    runtime_env["env_vars"].update(user.pop("env_vars", {}) or {})
    runtime_env.update(user)
    runtime_env["env_vars"].update({**(LOCAL_RAY_ENV if local else {}), **env_vars})
    return runtime_env


def logical_gpus(config) -> int:
    """Logical GPUs the local node declares: one per trainer rank on this one node, plus the
    standalone rollout pool's when replicas are not colocated (``hybrid_engine=false``)."""
    from omegaconf import OmegaConf

    from verl_modal.preflight import standalone_pool_gpus

    declared = OmegaConf.select(config, "ray_kwargs.ray_init.num_gpus", default=None)
    wanted = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes) + standalone_pool_gpus(config)
    return int(declared) if declared is not None else wanted


def quiet_separate_async_info_log(config) -> bool:
    """verl 0.9.1's ``separate_async`` trainer with ``hybrid_engine=false`` calls
    ``logger.info(..., flush=True)``, a TypeError whenever INFO is enabled for its logger.
    Raise that one module's level to WARNING (its other INFO lines are lost, nothing else).
    Skipped on a verl without the bug (``patches/verl/0001``); True when it acted."""
    import importlib
    import logging

    from omegaconf import OmegaConf

    from verl_modal import upstream

    if upstream.flush_fixed():
        return False
    mode = OmegaConf.select(config, "trainer.v1.trainer_mode", default="sync")
    if mode == "separate_async" and not OmegaConf.select(
        config, "actor_rollout_ref.hybrid_engine", default=True
    ):
        # Imported first: the module sets its logger's level from VERL_LOGGING_LEVEL on import.
        module = importlib.import_module("verl.trainer.ppo.v1.trainer_separate_async")
        module.logger.setLevel(logging.WARNING)
        return True
    return False


def start_local_ray(config, env_vars: dict[str, str]) -> None:
    """One Ray node on this machine, loopback only, with logical GPUs for the trainer ranks."""
    import ray

    if int(config.trainer.nnodes) != 1:
        raise ValueError(
            f"--backend local runs one node, but trainer.nnodes={config.trainer.nnodes}; "
            "use trainer.nnodes=1 (and trainer.n_gpus_per_node for more ranks)"
        )
    ray_init = dict(config.ray_kwargs.get("ray_init", {}) or {})
    ray_init.pop("runtime_env", None)
    ray.init(
        num_cpus=ray_init.pop("num_cpus", None),
        num_gpus=logical_gpus(config),
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        object_store_memory=ray_init.pop("object_store_memory", OBJECT_STORE_BYTES),
        runtime_env=runtime_env_for(config, env_vars),
        **{k: v for k, v in ray_init.items() if k != "num_gpus"},
    )
    addresses = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
    if addresses != {LOOPBACK}:
        ray.shutdown()
        raise RuntimeError(f"local Ray node is not on {LOOPBACK} only: {sorted(addresses)}")


def attach_ray(config, env_vars: dict[str, str]) -> None:
    """Bring-up on a cluster the cluster layer started: attach to it (``RAY_ADDRESS``, set by
    the Ray job that runs us) with verl's runtime env plus ``env_vars``, less what the job's
    own runtime env already sets (Ray refuses a driver runtime env that repeats a job's field
    or env key; the job's was built by the same launcher, and its ``working_dir`` is kept
    rather than cleared as verl's default would)."""
    import ray

    ray.init(runtime_env=driver_runtime_env(runtime_env_for(config, env_vars, local=False)))


def driver_runtime_env(runtime_env: dict) -> dict:
    """``runtime_env`` minus the fields and env keys the enclosing Ray job already sets."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    job = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR, "{}")).get("runtime_env") or {}
    job_env = job.get("env_vars") or {}
    out = {k: v for k, v in runtime_env.items() if k == "env_vars" or k not in job}
    out["env_vars"] = {k: v for k, v in runtime_env.get("env_vars", {}).items() if k not in job_env}
    return out


def _task_runner_base():
    from verl.trainer.main_ppo import TaskRunnerV1

    return TaskRunnerV1.__ray_actor_class__


def install_cpu(where: str) -> None:
    """In this Ray worker (``where`` names it): check that the cpu platform was selected here
    (the env that selects it arrived) and install its fixes."""
    import verl_modal.cpu.platform as cpu_platform
    from verl_modal.cpu import patches

    if not cpu_platform.selected():
        raise RuntimeError(f"VERL_PLATFORM=cpu did not reach {where}'s Ray worker")
    patches.install()


def _kept_options(given) -> dict:
    """``given``'s Ray actor options less :data:`DROPPED_RUNNER_OPTIONS`."""
    return {k: v for k, v in (given._default_options or {}).items() if k not in DROPPED_RUNNER_OPTIONS}


def make_task_runner(cpu: bool, base=None, options: dict | None = None):
    """verl's V1 TaskRunner (or ``base``, another main's TaskRunner class) as a Ray actor
    class that first installs our resource-pool manager (:mod:`verl_modal.pools`: waits for
    the cluster's GPUs) in its own process; with ``cpu``, it also installs and checks the cpu
    platform and fixes (and fails clearly if the env that selects them did not arrive).
    ``options``: the Ray actor options of the class (``ray.remote``'s)."""
    import ray

    base = base or _task_runner_base()
    remote = ray.remote(**options) if options else ray.remote

    class PoolTaskRunner(base):
        def run(self, config):
            from verl_modal import pools, upstream

            swapped = pools.install()
            from verl_modal import step_metrics

            step_metrics.install(config)  # modal_rl/ numbers into verl's metrics, this process
            quieted = quiet_separate_async_info_log(config)
            swap_main_actors(base.__module__, cpu, base)
            print(
                f"[verl_modal] verl's {base.__name__} in our setup; upstream fixes in this verl: {upstream.seams()}; "
                f"pool manager swapped in {swapped or 'none'}; separate_async INFO log quieted: {quieted}"
            )
            return super().run(config)

    PoolTaskRunner.__qualname__ = PoolTaskRunner.__name__ = "PoolTaskRunner"
    if not cpu:
        return remote(PoolTaskRunner)

    class CpuTaskRunner(PoolTaskRunner):
        def run(self, config):
            from verl.plugin.platform import get_platform

            import verl_modal.cpu.platform as cpu_platform
            from verl_modal.cpu import patches

            install_cpu("the TaskRunner")
            platform = get_platform()
            if not isinstance(platform, cpu_platform.PlatformCPU):
                raise RuntimeError(f"verl picked platform {type(platform).__name__}, not the cpu one")
            node = ray.util.get_node_ip_address()
            print(
                f"[verl_modal] TaskRunner on verl platform {platform.device_name!r}, node {node}; "
                f"fixes {patches.installed()}"
            )
            return super().run(config)

    CpuTaskRunner.__qualname__ = CpuTaskRunner.__name__ = "CpuTaskRunner"
    return remote(CpuTaskRunner)


# Ray actor options of another main's TaskRunner that our one-node run does not keep: verl's
# one-step-off TaskRunner asks for 10 CPUs so that a GPU cluster places it off the head node;
# here every process shares one node, and the TaskRunner takes one CPU, as verl's PPO one does.
DROPPED_RUNNER_OPTIONS = ("num_cpus",)


def task_runner_for(cpu: bool, given):
    """Our TaskRunner in place of ``given``, the Ray actor class a verl main hands ``run_ppo``:
    a subclass of its class with our setup first, its actor options less
    :data:`DROPPED_RUNNER_OPTIONS`."""
    return make_task_runner(cpu, base=given.__ray_actor_class__, options=_kept_options(given))


# Ray actor classes a main's TaskRunner creates by a module-level name, each running in a
# process of its own that our setup must reach: verl's fully-async main builds its trainer
# (weight syncs, step logging) and its rollouter (the rollout pool) as such actors.
MAIN_ACTORS = {
    "verl.experimental.fully_async_policy.fully_async_main": ("FullyAsyncTrainer", "FullyAsyncRollouter"),
}
_OURS = "__verl_modal_actor__"  # on an actor class of ours


def actor_setup(config, cpu: bool, name: str) -> None:
    """What a main's own actor (:data:`MAIN_ACTORS`) runs first in its process: our
    resource-pool manager and step metrics, as in the TaskRunner, and on CPU the check that
    the cpu platform was selected there (its fixes come with the platform module's import)."""
    from verl_modal import pools, step_metrics

    swapped = pools.install()
    step_metrics.install(config)
    if cpu:
        install_cpu(name)
    print(f"[verl_modal] verl's {name} in our setup; pool manager swapped in {swapped or 'none'}")


def actor_for(cpu: bool, given):
    """Our Ray actor class in place of ``given`` (a main's actor class whose constructor takes
    ``config``): a subclass that runs :func:`actor_setup` before verl's constructor, with
    ``given``'s actor options less :data:`DROPPED_RUNNER_OPTIONS` (verl's fully-async actors
    ask for 10 CPUs each, sized for a GPU node)."""
    import ray

    base = given.__ray_actor_class__
    options = _kept_options(given)

    class Ours(base):
        def __init__(self, *args, **kwargs):
            actor_setup(kwargs["config"] if "config" in kwargs else args[0], cpu, base.__name__)
            super().__init__(*args, **kwargs)

    Ours.__qualname__ = Ours.__name__ = base.__name__
    setattr(Ours, _OURS, True)
    return ray.remote(**options)(Ours) if options else ray.remote(Ours)


def swap_main_actors(module_name: str, cpu: bool, runner=None) -> list[str]:
    """In this process (a main's TaskRunner), the actor classes :data:`MAIN_ACTORS` names for
    ``module_name`` become ours (:func:`actor_for`) in the names the TaskRunner's methods see:
    the globals of ``runner``'s functions (Ray ships a decorated class by value, so those
    are a copy of the module's) and the module's; returns the names swapped. Idempotent."""
    import sys

    names = MAIN_ACTORS.get(module_name, ())
    module = sys.modules.get(module_name)
    spaces = [vars(module)] if module is not None else []
    for f in vars(runner).values() if runner is not None else ():
        space = getattr(f, "__globals__", None)
        if space is not None and all(space is not s for s in spaces):
            spaces.append(space)
    swapped: list[str] = []
    for space in spaces:
        for name in names:
            given = space.get(name)
            if given is not None and not getattr(given.__ray_actor_class__, _OURS, False):
                space[name] = actor_for(cpu, given)
                swapped.append(name)
    return swapped


def run_main(module: str, config, cpu: bool) -> None:
    """verl's main ``module`` (e.g. the one-step-off-policy one) on ``config``, unchanged: its
    ``@hydra.main`` function is called with the composed config (Hydra's passthrough), and the
    TaskRunner class it hands verl's ``run_ppo`` becomes ours (:func:`task_runner_for`) for
    that call only. Raises ``RuntimeError`` when the main returned without calling
    ``run_ppo`` (our setup would have been skipped)."""
    import importlib

    import verl.trainer.main_ppo as main_ppo

    verl_run_ppo = main_ppo.run_ppo
    called = []

    def run_ppo(cfg, task_runner_class):
        called.append(task_runner_class)
        return verl_run_ppo(cfg, task_runner_class=task_runner_for(cpu, task_runner_class))

    main_ppo.run_ppo = run_ppo  # the main imports the name when it runs
    try:
        importlib.import_module(module).main(config)
    finally:
        main_ppo.run_ppo = verl_run_ppo
    if not called:
        raise RuntimeError(f"{module}.main returned without calling verl's run_ppo; run it on a cluster")


def run(
    config, env_vars: dict[str, str], *, cpu: bool, bring_up: Callable | None = None, main: str | None = None
) -> None:
    """Bring up Ray, run verl's PPO on ``config`` (or verl's main ``main``, :func:`run_main`),
    shut down the Ray this process started."""
    import ray
    from verl.trainer.main_ppo import run_ppo

    from modal_rl.run_temp import process_temp

    with process_temp():
        (bring_up or start_local_ray)(config, env_vars)
        try:
            if main is None or main == "verl.trainer.main_ppo":
                run_ppo(config, task_runner_class=make_task_runner(cpu))
            else:
                run_main(main, config, cpu)
        finally:
            ray.shutdown()
