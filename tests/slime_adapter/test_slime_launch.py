"""``python -m slime_modal ... --dry-run -- <slime command line>``, offline.

The plan comes from the real launcher in a subprocess: the Modal function is built (not
deployed) and read back, so the GPU, cluster size and volumes checked here are what Modal
would be asked for. No Modal server, Ray or container is touched.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from modal_rl.cluster.plan import BootstrapPlan, address_env_values
from slime_modal import launch as L
from tests._launcher import run_module
from tests._slime_lines import GLM47_DISK_DIR, glm47_delta, qwen3_4b

GLM_VOLUMES = ["--volume", "models:/root/models", "--volume", "datasets:/root/datasets"]
GLM_VOLUMES += ["--volume", "glm-delta:/shared/fs"]


def launcher(*argv: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    return run_module("slime_modal", *argv, timeout=timeout)


def dry_plan(*argv: str) -> dict:
    out, _ = launcher(*argv)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_dry_run_plan_for_slimes_glm47_delta_example_matches_the_flags():
    line = glm47_delta()
    plan = dry_plan(
        "--backend",
        "modal",
        "--nodes",
        "4",
        "--gpu",
        "H100:8",
        *GLM_VOLUMES,
        "--dry-run",
        "--json",
        "--",
        *line,
    )

    assert plan["backend"] == "modal" and plan["preflight"] == "ok"
    assert plan["spec"]["nodes"] == 4 and plan["spec"]["gpu"] == "H100:8"
    assert plan["image"] == L.SLIME_IMAGE == "slimerl/slime:latest"
    volumes = {
        "/root/.cache/huggingface": "slime-hf-cache",
        "/root/models": "models",
        "/root/datasets": "datasets",
        "/shared/fs": "glm-delta",
    }
    inspected = plan["modal_function"]["inspected"]  # what Modal's app.function was handed
    assert inspected["gpu"] == "H100:8" and inspected["cluster_size"] == 4
    assert inspected["volumes"] == volumes
    # slime's 2 x 8 actor GPUs + its 16-GPU rollout pool (not colocated: delta mode forbids it)
    assert plan["slime"]["gpus"]["required"] == 32
    assert plan["rollout_engines"] is None

    hooks = [L.POST_WRITE_FLAG, L.POST_WRITE_HOOK, L.PRE_READ_FLAG, L.PRE_READ_HOOK]
    assert plan["slime"]["added_argv"] == hooks  # the disk dir is on the glm-delta Volume
    assert plan["entrypoint"] == ["python3", "/root/slime/train.py", *line, *hooks]
    assert plan["framework_argv"] == line

    env = plan["runtime_env"]["env_vars"]
    assert env["PYTHONPATH"] == "/root/Megatron-LM:/root/slime:${PYTHONPATH}"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["HF_HOME"] == "/root/.cache/huggingface"
    assert env["MODAL_RL_SANDBOX_BACKEND"] == "modal"
    assert json.loads(env[L.VOLUMES_ENV]) == volumes
    assert env["MODAL_RL_SLIME_ENTRY"] == "train.py"  # the rollout's staleness follows its loop
    assert plan["slime"]["address_env"] == {
        "SLIME_HOST_IP": "node",
        "MASTER_ADDR": "head",
        "no_proxy": "no_proxy",
        "NO_PROXY": "no_proxy",
    }


def test_rollout_engines_are_planned_off_the_cluster():
    line = glm47_delta()
    flags = ["--backend", "modal", "--nodes", "2", "--gpu", "H100:8", *GLM_VOLUMES]
    plan = dry_plan(*flags, "--rollout-engines", "modal:4:H100", "--dry-run", "--json", "--", *line)
    engines = plan["rollout_engines"]
    assert engines["count"] == 4 and engines["rollout_engines"] == "modal:4:H100"
    assert engines["gpu_per_engine"] == "H100:8"  # --rollout-num-gpus-per-engine 8 in the line
    assert engines["image"] == L.SLIME_IMAGE  # the cluster's image
    assert engines["command"][:3] == ["python3", "-m", "modal_rl.engines.keyed_launch"]
    assert "sglang.launch_server" in engines["command"]
    # Disk delta into a Volume: the engines' SGLang reloads the Volume before each read.
    hook = engines["command"].index("--custom-pull-weights-pre-read-hook")
    assert engines["command"][hook + 1] == L.PRE_READ_HOOK
    assert plan["slime"]["gpus"]["required"] == 16  # the rollout pool left the cluster
    assert plan["spec"]["nodes"] == 2


def test_engines_that_fail_to_start_stop_the_launch_before_the_job(tmp_path, monkeypatch):
    # A real local run: the engine command (SGLang, not installed here) exits at once; the
    # launcher reports it and never starts the cluster or the entry script.
    monkeypatch.setenv("MODAL_RL_RUN_KEY", "test-run-key")  # the engines' keyed launcher needs one
    marker = tmp_path / "entry-ran"
    entry = tmp_path / "probe.py"
    entry.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    line = ["--hf-checkpoint", str(tmp_path), "--rollout-num-gpus-per-engine", "1", "--actor-num-nodes", "1"]
    line += ["--actor-num-gpus-per-node", "1"]
    out, seconds = launcher(
        "--backend",
        "local",
        "--nodes",
        "1",
        "--entry",
        str(entry),
        "--rollout-engines",
        "modal:1",
        "--",
        *line,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "slime_modal: sglang-engine 0 exited with code 1 before it was healthy" in out.stderr
    assert "No module named 'sglang'" in out.stderr  # the engine's own last lines
    assert not marker.exists()


@pytest.mark.parametrize("bad", ["modal", "modal:0", "modal:4:", "local:4", "modal:x:H100"])
def test_rollout_engines_format_is_checked(bad):
    flags = ["--backend", "modal", "--gpu", "H100:8", "--rollout-engines", bad]
    out, seconds = launcher(*flags, "--dry-run", "--json", "--", "--lr", "1")
    assert out.returncode == 2 and seconds < 10
    assert out.stderr.strip().splitlines()[-1].startswith("slime_modal: --rollout-engines")


def test_qwen3_4b_on_volumes_and_env_overrides():
    line = qwen3_4b(root="/data")
    plan = dry_plan(
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--data-volume",
        "slime-data",
        "--hf-cache-volume",
        "none",
        "--env",
        "NCCL_NVLS_ENABLE=1",
        "--entry",
        "train_async.py",
        "--dry-run",
        "--json",
        "--",
        *line,
    )
    assert plan["spec"]["volumes"] == {"slime-data": "/data"}
    assert plan["spec"]["env"] == {"NCCL_NVLS_ENABLE": "1"}
    env = plan["runtime_env"]["env_vars"]
    assert "NCCL_NVLS_ENABLE" not in env  # the user's --env reaches the job, not our default
    assert "HF_HOME" not in env
    assert plan["slime"]["gpus"] == {"required": 8, "why": "actor 1 x 8 colocated with rollout 8"}
    assert plan["entrypoint"] == ["python3", "/root/slime/train_async.py", *line]
    assert plan["slime"]["added_argv"] == []  # no disk weight sync: argv untouched


def test_volume_hooks_only_for_disk_sync_into_a_volume_and_never_twice():
    line = glm47_delta()
    assert L.with_volume_hooks(line, ["/root/models"]) == (line, [])  # disk dir not on a Volume
    nccl = ["--update-weight-transport", "nccl", "--update-weight-disk-dir", GLM47_DISK_DIR]
    assert L.with_volume_hooks(nccl, ["/shared/fs"]) == (nccl, [])
    mine = [*line, "--custom-update-weight-post-write-path", "my.hooks.commit"]
    argv, added = L.with_volume_hooks(mine, ["/shared/fs"])
    assert added == [L.PRE_READ_FLAG, L.PRE_READ_HOOK]  # the user's post-write hook stays
    assert argv == [*mine, *added]
    full = ["--update-weight-transport=disk", f"--update-weight-disk-dir={GLM47_DISK_DIR}/full"]
    assert L.with_volume_hooks(full, ["/shared/fs"])[1][1] == L.POST_WRITE_HOOK


def test_local_backend_mounts_no_volumes_so_no_hooks(tmp_path):
    entry = tmp_path / "train.py"
    entry.write_text("")
    line = [*glm47_delta(), "--colocate"]  # refused: delta with colocate
    out, _ = launcher(
        "--backend", "local", "--entry", str(entry), *GLM_VOLUMES, "--dry-run", "--json", "--", *line
    )
    assert out.returncode == 2 and "--colocate" in out.stderr
    line = [x for x in glm47_delta() if not x.startswith("/root/")]  # drop the paths' values
    line = [x for x in line if x not in ("--hf-checkpoint", "--ref-load", "--prompt-data")]
    plan = dry_plan(
        "--backend",
        "local",
        "--nodes",
        "4",
        "--gpu",
        "H100:8",
        "--entry",
        str(entry),
        *GLM_VOLUMES,
        "--dry-run",
        "--json",
        "--",
        *line,
    )
    assert plan["slime"]["added_argv"] == [] and plan["entrypoint"] == [sys.executable, str(entry), *line]
    assert json.loads(plan["runtime_env"]["env_vars"][L.VOLUMES_ENV]) == {}
    assert "MODAL_RL_SANDBOX_BACKEND" not in plan["runtime_env"]["env_vars"]


def test_launcher_flags_after_the_separator_are_named_in_a_warning():
    line = qwen3_4b(root="/data")
    out, _ = launcher(
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--data-volume",
        "d",
        "--dry-run",
        "--json",
        "--",
        *line,
        "--nodes",
        "2",
        "--gpu=A100:8",
    )
    assert out.returncode == 0, out.stderr
    warnings = [x for x in out.stderr.splitlines() if "warning" in x]
    assert len(warnings) == 2 and "--nodes comes after `--`" in warnings[0] and "--gpu" in warnings[1]
    assert json.loads(out.stdout)["framework_argv"][-3:] == ["--nodes", "2", "--gpu=A100:8"]


def test_address_env_is_per_node_for_the_host_ip_and_shared_for_the_rest():
    plan = BootstrapPlan(nodes=3, gpus_per_node=8, entrypoint=["x"], address_env=L.ADDRESS_ENV)
    plan.addresses = ["10.0.0.5", "10.0.0.6", "10.0.0.7"]
    per_node, shared = address_env_values(plan, 2)
    assert per_node == {"SLIME_HOST_IP": "10.0.0.7"}
    assert shared["MASTER_ADDR"] == "10.0.0.5"
    assert shared["no_proxy"] == shared["NO_PROXY"] == "127.0.0.1,localhost,10.0.0.5,10.0.0.6,10.0.0.7"
    assert L.address_env({"MASTER_ADDR": "x"}).keys() == {"SLIME_HOST_IP", "no_proxy", "NO_PROXY"}


def test_job_request_refuses_an_unknown_address_kind():
    from modal_rl.cluster.backend import JobRequest

    with pytest.raises(ValueError, match="address_env kinds"):
        JobRequest(["x"], address_env={"SLIME_HOST_IP": "rank"})
