"""``python -m verl_modal --backend modal ... --dry-run -- <verl command line>``, offline.

The plan comes from the real launcher in a subprocess: verl's real config is composed and
validated, the Modal function is built (not deployed) and read back. No Modal server, Ray or
container is touched (``--dry-run`` starts nothing).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._launcher import run_module
from verl_modal.launch import cluster_job
from verl_modal.pools import PLACEMENT_ENV, WAIT_ENV

ROOT = Path(__file__).resolve().parents[2]

# A real multi-node GRPO command line, as in verl's examples (GSM8K, Qwen3-8B, 2 x 8 GPUs).
VERL_LINE = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=/data/gsm8k/train.parquet",
    "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.total_epochs=1",
]


def launcher(*argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    return run_module("verl_modal", *argv, timeout=timeout)


@pytest.mark.slow
def test_dry_run_plan_matches_the_flags_for_a_multi_node_verl_line():
    flags = ["--backend", "modal", "--nodes", "2", "--gpu", "H100:8", "--rdma"]
    flags += [
        "--volume",
        "hf-cache:/root/.cache/huggingface",
        "--volume",
        "ckpt:/ckpt",
        "--volume",
        "data:/data",
    ]
    flags += ["--env", "WANDB_PROJECT=grpo", "--job-timeout", "7200", "--join-timeout", "240"]
    overrides = ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", *VERL_LINE]
    out, _ = launcher(*flags, "--dry-run", "--json", "--", *overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)  # stdout is the plan and nothing else
    # verl probes this host's accelerator while validating; the cluster's GPUs are what count,
    # and GRPO has no critic by design: neither is worth a warning (verl_modal/cpu/quiet.py).
    for expected in (
        "No supported accelerator detected",
        "is registered but not available",
        "Disabled critic",
    ):
        assert expected not in out.stderr, out.stderr

    assert plan["backend"] == "modal"
    # The image is verl at the version installed here, with the extras this line uses, on a
    # CUDA base; every pin those extras declare is listed.
    from importlib.metadata import version

    image = plan["image"]
    assert plan["spec"]["image"] is None
    assert image["framework"] == f"verl[vllm,fsdp]=={version('verl')}"
    assert image["base"].startswith("nvidia/cuda:")
    assert image["pinned"]["vllm"] and image["pinned"]["torch"]
    assert image["chosen_by"]["vllm"] == "actor_rollout_ref.rollout.name=vllm"
    assert any("git apply" in c for c in image["build_commands"])  # patches/verl
    fn = plan["modal_function"]
    for view in (fn, fn["inspected"]):  # what we asked for, and what Modal was handed
        assert view["gpu"] == "H100:8"
        assert view["cluster_size"] == 2
        assert view["rdma"] is True
        assert view["timeout"] == 7200 + 240 + 600
    # the user's Volumes, and the one the run's folder (metrics, report) is kept on
    assert fn["volumes"] == {
        "hf-cache": "/root/.cache/huggingface",
        "ckpt": "/ckpt",
        "data": "/data",
        "modal-rl-runs": "/modal-rl-runs",
    }
    assert fn["inspected"]["volumes"] == {
        "/root/.cache/huggingface": "hf-cache",
        "/ckpt": "ckpt",
        "/data": "data",
        "/modal-rl-runs": "modal-rl-runs",
    }
    assert plan["env"]["WANDB_PROJECT"] == "grpo"
    assert plan["spec"]["env"] == {"WANDB_PROJECT": "grpo"}

    # The job: verl's driver, fed the user's line after the cluster's layer, in Hydra order.
    entry = plan["entrypoint"]
    assert entry[:4] == ["python", "-m", "verl_modal.launch", "--"]
    assert entry[4:6] == ["trainer.nnodes=2", "trainer.n_gpus_per_node=8"]
    assert entry[6:] == VERL_LINE
    assert plan["verl"]["overrides"] == entry[4:]
    assert plan["framework_argv"] == overrides
    assert plan["runtime_env"]["env_vars"][WAIT_ENV] == "240"  # pools wait as long as the join
    assert plan["verl"]["pool_placement"] == {"global_pool": [0, 1]}
    assert json.loads(plan["runtime_env"]["env_vars"][PLACEMENT_ENV]) == {"global_pool": [0, 1]}
    assert plan["preflight"] == "ok"
    # the driver keeps the run's folder on that Volume, and knows the command that launched it
    run_env = plan["runtime_env"]["env_vars"]
    assert re.fullmatch(r"/modal-rl-runs/verl-\d{8}-\d{6}", run_env["MODAL_RL_RUN_DIR"])
    assert run_env["MODAL_RL_RUN_COMMAND"].startswith("python -m verl_modal --backend modal --nodes 2 ")


@pytest.mark.slow
def test_standalone_rollout_replicas_get_the_last_nodes():
    line = [*VERL_LINE, "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=false"]
    line += [
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta",
    ]
    flags = ["--backend", "modal", "--nodes", "3", "--gpu", "H100:8", "--volume", "data:/data"]
    out, _ = launcher(*flags, "--dry-run", "--json", "--", *line)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    assert "trainer.nnodes=2" in plan["entrypoint"]
    # tensor_model_parallel_size=2 in VERL_LINE: 4 replicas of 2 GPUs on rank 2's 8 GPUs
    want = {"global_pool": [0, 1], **{f"rollout_pool_{i}": [2] for i in range(4)}}
    assert plan["verl"]["pool_placement"] == want
    assert json.loads(plan["runtime_env"]["env_vars"][PLACEMENT_ENV]) == want


@pytest.mark.slow
def test_nnodes_and_gpus_per_node_default_from_the_cluster_and_user_image_wins():
    out, _ = launcher(
        "--backend",
        "modal",
        "--nodes",
        "4",
        "--gpu",
        "H200:8",
        "--image",
        "me/verl:mine",
        "--volume",
        "data:/data",
        "--dry-run",
        "--json",
        "--",
        *VERL_LINE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    entry = plan["entrypoint"]
    assert "trainer.nnodes=4" in entry and "trainer.n_gpus_per_node=8" in entry
    assert plan["modal_function"]["cluster_size"] == 4
    assert plan["verl"]["cpu"] is False
    assert plan["image"] == "me/verl:mine"
    # a user image is not inspected: one line says what it must hold and how to check
    note = [line for line in out.stderr.splitlines() if "me/verl:mine" in line]
    assert len(note) == 1 and "verl==" in note[0] and "docker run" in note[0], out.stderr


def test_disagreeing_nnodes_exits_2_in_one_line_fast():
    out, elapsed = launcher(
        "--backend",
        "modal",
        "--nodes",
        "1",
        "--gpu",
        "H100:8",
        "--dry-run",
        "--json",
        "--",
        "trainer.nnodes=2",
        *VERL_LINE,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("verl_modal: trainer.nnodes=2 does not fit: the line's pools need 2 nodes")
    assert out.stdout == ""
    assert elapsed < 10.0, f"took {elapsed:.1f} s"


def test_disagreeing_gpus_per_node_exits_2():
    out, elapsed = launcher(
        "--backend", "modal", "--nodes", "2", "--gpu", "H100:8", "--", "trainer.n_gpus_per_node=4", *VERL_LINE
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "verl_modal: trainer.n_gpus_per_node=4 disagrees with the cluster (2 nodes x 8 GPUs); the cluster "
        "has 8 GPUs per node: drop trainer.n_gpus_per_node or change --nodes/--gpu"
    ]
    assert elapsed < 10.0


def test_bad_cluster_flag_exits_2_in_one_line():
    out, _ = launcher(
        "--backend", "modal", "--nodes", "2", "--gpu", "H100:4", "--dry-run", "--json", "--", *VERL_LINE
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "all GPUs of a host" in lines[0], out.stderr


def test_cluster_job_carries_the_cpu_env_only_for_cpu_runs():
    entry, runtime_env = cluster_job(["a=1"], cpu=False, join_timeout_s=30)
    assert entry == ["python", "-m", "verl_modal.launch", "--", "a=1"]
    assert runtime_env == {"env_vars": {WAIT_ENV: "30"}}
    entry, runtime_env = cluster_job(["a=1"], cpu=True, join_timeout_s=30, python="/py")
    assert entry == ["/py", "-m", "verl_modal.launch", "--cpu", "--", "a=1"]
    assert runtime_env["env_vars"]["VERL_PLATFORM"] == "cpu"
    assert "verl_modal.cpu.platform" in runtime_env["env_vars"]["VERL_USE_EXTERNAL_MODULES"]


def test_driver_runtime_env_leaves_what_the_job_sets_to_the_job(monkeypatch):
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    from verl_modal.runner import driver_runtime_env

    ours = {"env_vars": {"A": "1", "B": "2"}, "working_dir": None}
    monkeypatch.delenv(RAY_JOB_CONFIG_JSON_ENV_VAR, raising=False)
    assert driver_runtime_env(ours) == ours  # not under a Ray job: unchanged
    job = {"runtime_env": {"env_vars": {"A": "1"}, "working_dir": "/src"}}
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps(job))
    # Ray refuses a driver env that repeats the job's keys; the job's working_dir stays.
    assert driver_runtime_env(ours) == {"env_vars": {"B": "2"}}


def test_local_two_node_dry_run_plans_the_cpu_job_on_the_cluster(tmp_path):
    out, _ = launcher(
        "--backend",
        "local",
        "--nodes",
        "2",
        "--device",
        "cpu",
        "--tiny",
        str(tmp_path / "tiny"),
        "--dry-run",
        "--json",
        "--",
        "trainer.total_training_steps=1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    assert plan["backend"] == "local"
    assert plan["addresses"] == ["127.0.0.2", "127.0.0.2"]  # loopback only
    for argv in plan["ray_start"]:  # one logical GPU per node; CPUs for verl's bundles
        assert "--num-gpus=1" in argv and "--num-cpus=8" in argv
    entry = plan["entrypoint"]
    assert entry[:5] == [sys.executable, "-m", "verl_modal.launch", "--cpu", "--"]
    assert "trainer.nnodes=2" in entry and "trainer.n_gpus_per_node=1" in entry
    assert entry[-1] == "trainer.total_training_steps=1"
    env = plan["runtime_env"]["env_vars"]
    assert env["VERL_PLATFORM"] == "cpu" and env[WAIT_ENV] == "300"


def test_cluster_runs_do_not_inherit_the_one_node_ray_env(monkeypatch):
    """Local nodes inherit the launcher's env; Ray's single-node switch would make followers'
    ``ray start`` refuse to join ("Multi-node Ray clusters are not supported")."""
    from verl_modal.runner import prepare_process_env

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ["RAY_AUTH_MODE"] = "token"  # the cluster's (a Modal node's) mode, set by the bootstrap
    prepare_process_env({"X_TEST": "1"}, local=False)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    # The job's driver keeps the node's auth mode: forcing "disabled" would lock it out of a
    # token-authenticated cluster.
    assert os.environ["X_TEST"] == "1" and os.environ["RAY_AUTH_MODE"] == "token"
    prepare_process_env({}, local=True)
    assert (
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and os.environ["RAY_AUTH_MODE"] == "disabled"
    )


def test_detach_is_refused_for_a_local_in_process_run():
    out, elapsed = launcher("--device", "cpu", "--detach", "--")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "verl_modal: --detach is not available with --backend local (a local run lives as long as this process)"
    ]
    assert elapsed < 10.0
