"""Launcher side of slime's rollout-manager seam (``patches/slime/0004``: ``--rollout-manager-path``).

Where the slime checkout has the seam (:func:`seam_present`: read from its source, never from a
version string) and the run asks for ``--rollout-engines`` on the local backend, the launcher
starts no engines and no forwarder itself. It adds to slime's argv (:func:`manager_argv`):

- ``--rollout-manager-path slime_modal.rollout_manager.ModalRolloutManager``: slime builds our
  subclass of its ``RolloutManager`` as the rollout actor, which starts and owns the engines
  (``slime_modal.rollout_manager``);
- ``--rollout-num-gpus 0``: the engines run on their own processes/machines, so slime's
  placement group reserves no GPUs for rollout (with ``--rollout-external-engine-addrs`` slime
  derives the same from the engines, which at parse time do not exist yet on this path);
- ``--use-fault-tolerance``: only then does slime's trainer call the rollout actor's
  ``recover_updatable_engines`` before each weight update, where ours waits until every engine
  serves (a replacement caught up) or says which slot is gone; slime's own health monitors
  watch server groups its external-engine server does not have, so none start;

and puts what the manager needs to start them into the job's env as :data:`CONFIG_ENV` (JSON,
:func:`manager_env`): the engine spec (``slime_modal.engines.engine_spec``: the same SGLang
command line as the fallback), the pool backend, slime's weight path (what a replacement is
caught up through) and the supervisor's health settings. No key is in it: the manager's
process holds the run's key as every process of the job does.

Without the seam (an unpatched slime), or on Modal (there the manager would start Modal engines
from inside the cluster, which no test here covers yet), the fallback stays: the launcher's
engines, the job through ``slime_modal.engine_job``'s key forwarder, and the routes file.
"""

from __future__ import annotations

import json
import os
from typing import Any

from slime_modal.engines import EnginesRequest, WeightPath, engine_spec, replacement_problem
from slime_modal.preflight import SlimeArgs

MANAGER_PATH = "slime_modal.rollout_manager.ModalRolloutManager"
PATH_FLAG = "--rollout-manager-path"
GPUS_FLAG = "--rollout-num-gpus"
RECOVER_FLAG = "--use-fault-tolerance"
CONFIG_ENV = "MODAL_RL_SLIME_ENGINES"
# Both places the seam touches: the option, and create_rollout_manager reading it.
SEAM_SOURCES = {
    "slime/utils/arguments.py": '"--rollout-manager-path"',
    "slime/ray/placement_group.py": "rollout_manager_path",
}


def seam_present(slime_path: str) -> bool:
    """Whether the slime checkout at ``slime_path`` reads ``--rollout-manager-path``."""
    for rel, needle in SEAM_SOURCES.items():
        try:
            with open(os.path.join(slime_path, rel), encoding="utf-8") as f:
                if needle not in f.read():
                    return False
        except OSError:
            return False
    return True


def uses_manager(slime_path: str, backend: str, engines: EnginesRequest | None) -> bool:
    """Whether this run's engines are owned by our rollout manager (module docstring)."""
    return engines is not None and backend == "local" and seam_present(slime_path)


def manager_argv(slime_argv: list[str]) -> list[str]:
    """slime's argv plus the manager's flags (module docstring); ValueError when the user set
    the path or a rollout GPU count."""
    args = SlimeArgs(slime_argv)
    if args.has(PATH_FLAG):
        raise ValueError(f"{PATH_FLAG} is set by --rollout-engines (our rollout manager); drop it")
    if args.has(GPUS_FLAG) and args.int(GPUS_FLAG, 0) != 0:
        raise ValueError(
            f"{GPUS_FLAG} with --rollout-engines: the engines run on their own machines; drop it"
        )
    added = [PATH_FLAG, MANAGER_PATH] + ([] if args.has(GPUS_FLAG) else [GPUS_FLAG, "0"])
    return [*slime_argv, *added, *([] if args.has(RECOVER_FLAG) else [RECOVER_FLAG])]


def manager_env(
    request: EnginesRequest,
    slime_argv: list[str],
    backend: str = "local",
    *,
    health: dict[str, Any] | None = None,
    pool_kwargs: dict[str, Any] | None = None,
    **spec_opts: Any,
) -> dict[str, str]:
    """``{CONFIG_ENV: json}`` for the job's env. Replacement follows the fallback's rule
    (``replacement_problem``): with NCCL weights a lost engine is reported, not replaced."""
    spec = engine_spec(request, slime_argv, **spec_opts)
    weights = WeightPath.from_argv(slime_argv)
    health = dict(health or {})
    if replacement_problem(slime_argv, "local") is not None:
        health["max_replacements"] = 0
    config = {
        "spec": spec.to_dict(),
        "backend": backend,
        "weights": {
            "transport": weights.transport,
            "disk_dir": weights.disk_dir,
            "local_checkpoint_dir": weights.local_checkpoint_dir,
        },
        "health": health,
        "pool": dict(pool_kwargs or {}),
    }
    return {CONFIG_ENV: json.dumps(config, sort_keys=True)}


def plan(slime_path: str, backend: str, engines: EnginesRequest | None) -> dict[str, Any]:
    """The dry-run plan's ``rollout_manager`` section."""
    if engines is None:
        return {"used": False, "why": "no --rollout-engines"}
    if not uses_manager(slime_path, backend, engines):
        why = (
            "Modal backend" if backend != "local" else f"{slime_path} lacks {PATH_FLAG} (patches/slime/0004)"
        )
        return {"used": False, "why": f"{why}: launcher-owned engines, key forwarder and routes file"}
    return {"used": True, "class": MANAGER_PATH, "env": CONFIG_ENV}
