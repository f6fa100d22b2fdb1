"""Where a cluster run keeps its folder (metrics.jsonl, run.json, generations, report.html).

A local run keeps it under its log dir on this machine. A cluster run's driver (the Ray job
on rank 0) gets the folder's path in :data:`RUN_DIR_ENV` and the launching command line in
:data:`RUN_COMMAND_ENV`; on ``--backend modal`` that path is on a Modal Volume,
:data:`RUNS_VOLUME` mounted at :data:`RUNS_MOUNT` on every node, so the folder outlives the
containers and is fetched with ``modal volume get modal-rl-runs <name>``.

Invariants: the launcher decides the folder's name once (:func:`run_name`) and prints it;
a Volume the user already mounts at :data:`RUNS_MOUNT` is used as it is (no second mount);
nothing here contacts Modal (the Volume is created, if missing, when the function starts).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

RUN_DIR_ENV = "MODAL_RL_RUN_DIR"
RUN_COMMAND_ENV = "MODAL_RL_RUN_COMMAND"
RUNS_VOLUME = "modal-rl-runs"
RUNS_MOUNT = "/modal-rl-runs"


@dataclass(frozen=True)
class RunFolder:
    name: str  # the run's folder name, printed by the launcher
    path: str  # where the driver writes it (a Volume path on Modal)
    volume: str | None  # the Modal Volume holding it, None for a local cluster

    def fetch_hint(self) -> str:
        """How the user gets the folder onto their machine."""
        if self.volume is None:
            return f"report and metrics in {self.path}"
        return (
            f"report and metrics in Modal Volume {self.volume}, folder {self.name}: "
            f"`modal volume get {self.volume} {self.name} .` fetches it, then open {self.name}/report.html"
        )


def run_name(framework: str, now: float | None = None) -> str:
    """``<framework>-<UTC time>``: one folder per launch."""
    return f"{framework}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}"


def with_run_folder(spec, backend: str, name: str, log_dir: Path | None, command: str):
    """``(spec, env, folder)``: the spec with the runs Volume mounted (Modal), the env the
    job's driver needs (:data:`RUN_DIR_ENV`, :data:`RUN_COMMAND_ENV`) and the folder."""
    if backend == "modal":
        mounted = {path: vol for vol, path in spec.volumes.items()}
        volume = mounted.get(RUNS_MOUNT, RUNS_VOLUME)
        if RUNS_MOUNT not in mounted:
            if volume in spec.volumes:  # the user mounts our Volume elsewhere: keep their mount
                folder = RunFolder(name, f"{spec.volumes[volume].rstrip('/')}/{name}", volume)
                return spec, _env(folder, command), folder
            spec = dataclasses.replace(spec, volumes={**spec.volumes, RUNS_VOLUME: RUNS_MOUNT})
        folder = RunFolder(name, f"{RUNS_MOUNT}/{name}", volume)
    else:
        base = Path(log_dir or "runs/cluster/logs").expanduser().resolve()
        folder = RunFolder(name, str(base / name), None)
    return spec, _env(folder, command), folder


def _env(folder: RunFolder, command: str) -> dict[str, str]:
    return {RUN_DIR_ENV: folder.path, RUN_COMMAND_ENV: command}
