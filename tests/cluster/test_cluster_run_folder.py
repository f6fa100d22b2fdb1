"""Where a cluster run's folder lives: on Modal, a Volume every node mounts (built offline
into the function's settings); on a local cluster, a folder under the log dir."""

from __future__ import annotations

import re

from modal_rl.cluster.backend_modal import ModalBackend
from modal_rl.cluster.run_folder import (
    RUN_COMMAND_ENV,
    RUN_DIR_ENV,
    RUNS_MOUNT,
    RUNS_VOLUME,
    run_name,
    with_run_folder,
)
from modal_rl.cluster.spec import ClusterSpec


def test_a_modal_run_keeps_its_folder_on_the_runs_volume():
    spec = ClusterSpec(nodes=2, gpu="H100:8", volumes={"data": "/data"})
    name = run_name("verl", now=0)
    assert name == "verl-19700101-000000"
    got, env, folder = with_run_folder(spec, "modal", name, None, "python -m verl_modal --backend modal")
    assert got.volumes == {"data": "/data", RUNS_VOLUME: RUNS_MOUNT} and spec.volumes == {"data": "/data"}
    assert env == {
        RUN_DIR_ENV: f"{RUNS_MOUNT}/{name}",
        RUN_COMMAND_ENV: "python -m verl_modal --backend modal",
    }
    assert f"modal volume get {RUNS_VOLUME} {name} ." in folder.fetch_hint()
    # the function Modal is handed mounts it on every node
    _, fn = ModalBackend().build_function(got, key="k" * 43)
    from modal_rl.modal_calls import inspect_function

    assert inspect_function(fn)["volumes"] == {"/data": "data", RUNS_MOUNT: RUNS_VOLUME}


def test_a_volume_the_user_mounts_there_or_ours_elsewhere_is_used_as_given():
    mine = ClusterSpec(nodes=1, gpu="H100:1", volumes={"my-runs": RUNS_MOUNT})
    got, env, folder = with_run_folder(mine, "modal", "verl-x", None, "c")
    assert got == mine and folder.volume == "my-runs" and env[RUN_DIR_ENV] == f"{RUNS_MOUNT}/verl-x"
    moved = ClusterSpec(nodes=1, gpu="H100:1", volumes={RUNS_VOLUME: "/vol/runs"})
    got, env, folder = with_run_folder(moved, "modal", "verl-x", None, "c")
    assert got == moved and env[RUN_DIR_ENV] == "/vol/runs/verl-x" and folder.volume == RUNS_VOLUME


def test_a_local_cluster_keeps_it_under_the_log_dir(tmp_path):
    spec = ClusterSpec(nodes=2)
    got, env, folder = with_run_folder(spec, "local", "verl-x", tmp_path / "logs", "c")
    assert got == spec and folder.volume is None
    assert env[RUN_DIR_ENV] == str((tmp_path / "logs" / "verl-x").resolve())
    assert re.search(r"report and metrics in /\S+/logs/verl-x$", folder.fetch_hint())
