"""ClusterSpec validation, CLI plumbing, preflight and plan building: no process is started."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from modal_rl.cluster import cli, preflight
from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backend_local import LOOPBACK, LocalBackend
from modal_rl.cluster.netif import interface_for
from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.raynode import ray_start_argv
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError, GpuSpec


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nodes": 0}, "between 1 and 32"),
        ({"nodes": 33}, "between 1 and 32"),
        ({"nodes": 2.0}, "must be an integer"),
        ({"nodes": 2, "gpu": "H100:4"}, "all GPUs of a host"),
        ({"nodes": 2, "gpu": "T4:1"}, "not offered for multi-node"),
        ({"gpu": "Z9:8"}, "unknown GPU type"),
        ({"gpu": "H100:x"}, "not an integer"),
        ({"gpu": "H100:0"}, "at least 1"),
        ({"rdma": True}, "rdma=True needs GPUs"),
        ({"volumes": {"bad name": "/x"}}, "volume name 'bad name'"),
        ({"volumes": {"ckpt": "relative"}}, "must be absolute"),
        ({"volumes": {"a": "/m", "b": "/m"}}, "both mount at '/m'"),
        ({"secrets": ("",)}, "secret name"),
        ({"env": {"1BAD": "x"}}, "env key '1BAD'"),
        ({"join_timeout_s": 0}, "join_timeout_s=0"),
        ({"job_timeout_s": -1}, "job_timeout_s=-1"),
        ({"retries": -1}, "retries=-1"),
        ({"cpu": 0}, "cpu=0"),
        ({"gpu": "H100:16"}, "at most 8 H100 GPUs; use --gpu H100:8 with more --nodes"),
        ({"gpu": "A10:8"}, "at most 4 A10"),
        ({"volumes": {"x": "/root"}}, "cannot mount a Volume at /root"),
        ({"volumes": {"x": "/tmp"}}, "cannot mount a Volume at /tmp"),
        ({"volumes": {"x": "/data/../ckpt"}}, "use --volume x:/ckpt"),
    ],
)
def test_bad_spec_names_the_field(kwargs, needle):
    with pytest.raises(ClusterSpecError, match=None) as err:
        ClusterSpec(**kwargs)
    assert needle in str(err.value)


class NoProcess(subprocess.Popen):
    """Stands in for Popen (still a class, so modules that annotate with it import fine)."""

    def __init__(self, *args, **kwargs):
        raise AssertionError(f"a process was started: {args}")


def test_good_spec_round_trips_and_counts_gpus():
    spec = ClusterSpec(
        nodes=4, gpu="h100:8", rdma=True, volumes={"ckpt": "/ckpt"}, secrets=["wandb"], env={"A": 1}
    )
    assert spec.gpu_spec == GpuSpec("H100", 8) and spec.gpus_per_node == 8
    assert spec.secrets == ("wandb",) and spec.env == {"A": "1"}
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert ClusterSpec(nodes=3).gpus_per_node == 1  # logical GPUs of the local backend
    assert ClusterSpec(nodes=1, gpu="A10G:1").gpus_per_node == 1  # single node: any count
    with pytest.raises(ClusterSpecError, match="unknown ClusterSpec fields: bogus"):
        ClusterSpec.from_dict({"bogus": 1})


@pytest.mark.parametrize(
    "gpu", ["H100!", "H100!:8", "B200+:8", "RTX-PRO-6000", "rtx-pro-6000:2", "A10", "L40S:4"]
)
def test_every_modal_gpu_name_is_accepted(gpu):
    parsed = GpuSpec.parse(gpu)
    assert str(parsed) == f"{gpu.split(':')[0].upper()}:{gpu.split(':')[1] if ':' in gpu else 1}"


def test_rdma_defaults_on_for_multi_node_fabric_gpus_and_says_so_when_off():
    from modal_rl.cluster.spec import rdma_note

    assert cli.spec_from_args(_parse(["--nodes", "2", "--gpu", "H100:8"])).rdma is True
    assert cli.spec_from_args(_parse(["--nodes", "2", "--gpu", "B200+:8"])).rdma is True
    assert cli.spec_from_args(_parse(["--nodes", "1", "--gpu", "H100:8"])).rdma is False
    assert cli.spec_from_args(_parse(["--nodes", "2", "--gpu", "A100-80GB:8"])).rdma is False
    off = cli.spec_from_args(_parse(["--nodes", "2", "--gpu", "H100:8", "--no-rdma"]))
    assert off.rdma is False and "drop --no-rdma" in rdma_note(off)
    assert "not on Modal's RDMA fabric" in rdma_note(ClusterSpec(nodes=2, gpu="A100:8"))
    assert rdma_note(ClusterSpec(nodes=2, gpu="H200:8", rdma=True)) is None
    assert rdma_note(ClusterSpec(nodes=1, gpu="H200:8")) is None


def test_modals_own_volume_refusal_is_one_line_exit_2():
    from modal_rl.cli_errors import describe

    class InvalidError(Exception):
        pass

    InvalidError.__module__ = "modal.exception"
    line, code = describe(InvalidError("Volume /root cannot be mounted at '/root'."))
    assert code == 2 and line.startswith("Modal refuses this setting: Volume /root")
    assert describe(ClusterSpecError("gpu='H100:16': at most 8"))[1] == 2


def test_split_passthrough_keeps_framework_args_untouched():
    ours, theirs = cli.split_passthrough(["--nodes", "2", "--", "--nodes", "9", "a=b", "--"])
    assert ours == ["--nodes", "2"] and theirs == ["--nodes", "9", "a=b", "--"]
    assert cli.split_passthrough(["--nodes", "2"]) == (["--nodes", "2"], [])


def _parse(argv):
    parser = argparse.ArgumentParser()
    cli.add_cluster_args(parser)
    return parser.parse_args(argv)


def test_cluster_flags_build_the_spec():
    args = _parse(
        ["--backend", "modal", "--nodes", "4", "--gpu", "H200:8", "--rdma", "--volume", "ckpt:/ckpt"]
        + ["--volume", "data:/data", "--env", "A=1", "--env", "B=x=y", "--secret", "hf", "--retries", "2"]
    )
    spec = cli.spec_from_args(args)
    assert (spec.nodes, spec.gpu, spec.rdma, spec.retries) == (4, "H200:8", True, 2)
    assert spec.volumes == {"ckpt": "/ckpt", "data": "/data"} and spec.env == {"A": "1", "B": "x=y"}
    assert spec.secrets == ("hf",)
    assert cli.spec_from_args(_parse(["--no-rdma"])).rdma is False
    with pytest.raises(SystemExit):
        _parse(["--env", "NOEQUALS"])
    with pytest.raises(SystemExit):
        _parse(["--volume", "nopath"])
    with pytest.raises(ClusterSpecError, match="given twice"):
        cli.spec_from_args(_parse(["--volume", "a:/x", "--volume", "a:/y"]))


def test_preflight_collects_every_problem_and_runs_adapter_validators():
    spec = ClusterSpec(nodes=2, env={"RAY_ADDRESS": "x"}, volumes={"a": "/m", "b": "/m/sub"})
    plan = BootstrapPlan(
        nodes=2, gpus_per_node=1, entrypoint=["true"], gcs_port=80, dashboard_port=9000, control_port=9000
    )

    def verl_like(spec, argv):
        return [
            f"trainer.nnodes={a.split('=')[1]} but the cluster has {spec.nodes}"
            for a in argv
            if a.startswith("trainer.nnodes=")
        ]

    def broken(spec, argv):
        raise KeyError("boom")

    with pytest.raises(preflight.PreflightError) as err:
        preflight.run_preflight(spec, ["trainer.nnodes=3"], [verl_like, broken], plan=plan, required_gpus=5)
    problems = err.value.problems
    assert any("asks for 5 GPUs" in p for p in problems)
    assert any("gcs port 80 is outside" in p for p in problems)
    assert any("ports must be distinct" in p for p in problems)
    assert any("RAY_ADDRESS" in p for p in problems)
    assert any("contains another mount" in p for p in problems)
    assert any("trainer.nnodes=3 but the cluster has 2" in p for p in problems)
    assert any("raised KeyError" in p for p in problems)
    assert preflight.run_preflight(ClusterSpec(nodes=2), [], [verl_like], required_gpus=2) == []


def test_local_plan_pins_loopback_and_gives_each_node_its_own_ports():
    plan = LocalBackend().make_plan(ClusterSpec(nodes=3), JobRequest(["true"]))
    assert plan.addresses == [LOOPBACK] * 3 and interface_for(LOOPBACK) == "lo"
    argvs = [ray_start_argv(plan, r) for r in range(3)]
    for rank, argv in enumerate(argvs):
        assert f"--node-ip-address={LOOPBACK}" in argv
        assert f'--resources={{"modal_rl_rank_{rank}": 1}}' in argv
        assert f"--temp-dir={plan.temp_root}/r{rank}" in argv
        assert "--num-gpus=1" in argv
    assert "--head" in argvs[0] and f"--address={LOOPBACK}:{plan.gcs_port}" in argvs[1]
    ports = [
        a.split("=")[1] for argv in argvs for a in argv if a.endswith(tuple("0123456789")) and "-port=" in a
    ]
    ports.append(str(plan.control_port))  # the head's --port and --dashboard-port are in argvs[0]
    assert len(ports) == len(set(ports)) == 3 * 6 + 4
    again = BootstrapPlan.from_json(plan.to_json())
    assert again == plan


def test_bad_spec_fails_before_any_process_starts(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "Popen", NoProcess)
    from modal_rl.cluster.__main__ import main

    assert main(["smoke", "--nodes", "33"]) == 2  # one line (modal_rl.cli_errors), no SystemExit
    err = capsys.readouterr().err
    assert "between 1 and 32" in err and len(err.strip().splitlines()) == 1
    # A preflight failure also stops before anything is started.
    code = cli.run_job(ClusterSpec(nodes=2, env={"CUDA_VISIBLE_DEVICES": "0"}), ["true"], backend="local")
    assert code == 2
    assert "CUDA_VISIBLE_DEVICES must not be set" in capsys.readouterr().err
    assert cli.run_job(ClusterSpec(nodes=2), ["true"], detach=True) == 2
    assert "--detach is not available with --backend local" in capsys.readouterr().err


def test_local_dry_run_prints_a_plan_without_starting_anything(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "Popen", NoProcess)
    code = cli.run_job(
        ClusterSpec(nodes=2), [sys.executable, "train.py"], {"env_vars": {"X": "1"}}, dry_run=True, json=True
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["backend"] == "local" and plan["addresses"] == [LOOPBACK, LOOPBACK]
    assert plan["env"]["GLOO_SOCKET_IFNAME"] == "lo" and plan["env"]["RAY_AUTH_MODE"] == "disabled"
    assert plan["ray_auth"] == "disabled" and plan["env"]["MODAL_RL_RUN_KEY"] == "<redacted>"
    assert plan["entrypoint"] == [sys.executable, "train.py"] and len(plan["commands"]) == 2
