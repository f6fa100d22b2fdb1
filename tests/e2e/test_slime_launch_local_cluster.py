"""``python -m slime_modal --backend local --nodes 2 --entry <probe> -- <slime args>`` on a real
2-node Ray cluster on localhost (the same bootstrap a Modal cluster runs).

The probe stands in for slime's ``train.py``: it is submitted as the cluster's Ray job exactly
as ``train.py`` would be, and records what it got (argv, env, Ray's nodes, and the env a Ray
task on the *other* node sees) into a JSON file. After the launcher returns, no process of the
run may be left.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from modal_rl.cluster import procs
from modal_rl.cluster.backend_local import LOOPBACK
from slime_modal.launch import with_reward_groups
from tests.slime_adapter.test_slime_launch import launcher

pytestmark = pytest.mark.slow

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import ray

    KEYS = ["SLIME_HOST_IP", "MASTER_ADDR", "no_proxy", "NO_PROXY", "PYTHONPATH", "NCCL_NVLS_ENABLE",
            "CUDA_DEVICE_MAX_CONNECTIONS", "MODAL_RL_VOLUMES", "MODAL_RL_RUN_ID"]
    ray.init()
    nodes = [n for n in ray.nodes() if n["Alive"]]

    @ray.remote(num_cpus=0, resources={"modal_rl_rank_1": 0.01})
    def on_rank_1():
        return {k: os.environ.get(k) for k in KEYS}

    record = {
        "argv": sys.argv[1:],
        "env": {k: os.environ.get(k) for k in KEYS},
        "alive_nodes": len(nodes),
        "node_ips": sorted(n["NodeManagerAddress"] for n in nodes),
        "rank_1_env": ray.get(on_rank_1.remote()),
    }
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(record, f)
    print("probe done", flush=True)
    """
)


def slime_args(model_dir: str) -> list[str]:
    """30+ tokens of a slime line with the awkward cases: spaces, quotes, JSON, a repeated flag,
    a bare ``--`` and ``--x=y`` inside, an empty value, ``$VAR`` that no shell may expand."""
    return [
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--rollout-num-gpus-per-engine",
        "1",
        "--hf-checkpoint",
        model_dir,
        "--lr",
        "1e-6",
        "--lr",
        "2e-6",
        "--wandb-group",
        "my run (1) 'quoted' \"double\"",
        "--train-env-vars",
        '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "A": "x y"}',
        "--sglang-extra",
        "--",
        "--eval-prompt-data",
        "aime",
        "/data/aime 2024.jsonl",
        "--rm-type",
        "deepscaler",
        "--custom-rm-path",
        "slime_modal.reward.reward_func",
        "--rollout-stop",
        "$HOME",
        "`id`",
        "a;b|c&d",
        "",
        "--kl-coef=-0.01",
        "--note",
        "line1\nline2\ttab ü",
        "--",
        "--trailing",
        "after-separator",
    ]


@pytest.mark.timeout(400)
def test_probe_runs_as_the_job_on_two_nodes_with_exact_argv_and_nothing_left(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    model = tmp_path / "model dir"
    model.mkdir()
    out_file = tmp_path / "record.json"
    args = slime_args(str(model))
    assert len(args) >= 30
    out, seconds = launcher(
        "--backend",
        "local",
        "--nodes",
        "2",
        "--join-timeout",
        "150",
        "--entry",
        str(probe),
        "--env",
        f"PROBE_OUT={out_file}",
        "--",
        *args,
        timeout=380,
    )
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout[-2000:]
    assert "probe done" in out.stdout  # rank 0 streamed the job's log
    record = json.loads(out_file.read_text())

    # byte for byte, through argparse, shlex, Ray and the shell; our reward brings its documented
    # post-processing flag (slime_modal.reward_groups)
    argv, added = with_reward_groups(args)
    assert added and record["argv"] == argv
    assert record["alive_nodes"] == 2 and record["node_ips"] == [LOOPBACK, LOOPBACK]
    env = record["env"]
    assert env["SLIME_HOST_IP"] == env["MASTER_ADDR"] == LOOPBACK
    assert env["no_proxy"] == env["NO_PROXY"] == f"127.0.0.1,localhost,{LOOPBACK}"
    assert env["PYTHONPATH"].startswith("/root/Megatron-LM:/root/slime:")
    assert "${PYTHONPATH}" not in env["PYTHONPATH"]  # Ray expanded it with the node's own
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # A Ray task on the other node: the job's runtime env and that node's own host IP.
    other = record["rank_1_env"]
    assert other["SLIME_HOST_IP"] == LOOPBACK and other["NCCL_NVLS_ENABLE"] == "0"
    assert other["MODAL_RL_RUN_ID"] == env["MODAL_RL_RUN_ID"]

    assert procs.pids_of_run(env["MODAL_RL_RUN_ID"]) == []
    print(f"launcher wall time {seconds:.1f} s")
