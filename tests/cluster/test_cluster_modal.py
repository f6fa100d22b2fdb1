"""Modal backend, offline: the clustered function's settings must match the flags.

No Modal server is contacted: the app and function are defined locally and read back.
The live test runs only when MODAL_TOKEN_ID is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest

from modal_rl import run_temp
from modal_rl.cluster import cli
from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backend_modal import ModalBackend, function_kwargs, inspect_function
from modal_rl.cluster.bootstrap import refresh_ray_auth_cache
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError
from modal_rl.run_key import key_env, new_run_key


class NoProcess(subprocess.Popen):
    """Stands in for Popen (still a class, so modules that annotate with it import fine)."""

    def __init__(self, *args, **kwargs):
        raise AssertionError(f"a process was started: {args}")


def _dry_run(argv, capsys):
    ours, theirs = cli.split_passthrough(argv)
    parser = argparse.ArgumentParser()
    cli.add_cluster_args(parser)
    args = parser.parse_args(ours)
    code = cli.run_job(
        cli.spec_from_args(args),
        ["python3", "train.py", *theirs],
        backend=args.backend,
        framework_argv=theirs,
        **cli.run_options(args),
    )
    return code, capsys.readouterr()


def test_dry_run_plan_matches_the_flags(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "Popen", NoProcess)
    code, captured = _dry_run(
        ["--backend", "modal", "--nodes", "4", "--gpu", "H100:8", "--rdma", "--volume", "ckpt:/ckpt"]
        + ["--volume", "hf-cache:/root/.cache/huggingface", "--job-timeout", "7200", "--join-timeout", "300"]
        + ["--retries", "1", "--secret", "wandb", "--dry-run", "--json", "--", "--lr", "1e-6"],
        capsys,
    )
    assert code == 0, captured.err
    plan = json.loads(captured.out)
    fn = plan["modal_function"]
    for view in (fn, fn["inspected"]):  # what we derived, and what Modal was handed
        assert view["gpu"] == "H100:8"
        assert view["cluster_size"] == 4
        assert view["rdma"] is True
        assert view["timeout"] == 7200 + 300 + 600
        assert view["retries"] == 1
    assert fn["volumes"] == {"ckpt": "/ckpt", "hf-cache": "/root/.cache/huggingface"}
    assert fn["inspected"]["volumes"] == {"/ckpt": "ckpt", "/root/.cache/huggingface": "hf-cache"}
    user, run = fn["inspected"]["secrets"]  # the user's secret, then the one made for this run
    assert "wandb" in user and "MODAL_RL_RUN_KEY" in run and "RAY_AUTH_TOKEN" in run
    assert fn["secrets"] == ["wandb", "run secret (MODAL_RL_RUN_KEY, RAY_AUTH_TOKEN): made for this run"]
    assert plan["framework_argv"] == ["--lr", "1e-6"]
    assert plan["entrypoint"] == ["python3", "train.py", "--lr", "1e-6"]
    assert plan["env"]["RAY_AUTH_MODE"] == "token" and "NCCL_SOCKET_IFNAME" in plan["env"]
    assert plan["ray_auth"] == "token" and plan["dashboard"] == "off"
    assert plan["env"]["RAY_AUTH_TOKEN"].startswith("<redacted>")


def test_other_flags_change_the_function(capsys):
    code, captured = _dry_run(
        ["--backend", "modal", "--nodes", "2", "--gpu", "B200:8", "--no-rdma", "--dry-run", "--json"], capsys
    )
    assert code == 0, captured.err
    inspected = json.loads(captured.out)["modal_function"]["inspected"]
    assert (inspected["gpu"], inspected["cluster_size"], inspected["rdma"]) == ("B200:8", 2, False)
    assert inspected["volumes"] == {} and inspected["retries"] == 0


def test_modal_backend_refuses_cpu_only_clusters(capsys):
    code, captured = _dry_run(["--backend", "modal", "--nodes", "2", "--dry-run", "--json"], capsys)
    assert code == 2 and "needs --gpu" in captured.err
    with pytest.raises(ClusterSpecError, match="needs --gpu"):
        ModalBackend().build_function(ClusterSpec(nodes=2))


def test_timeout_is_capped_at_modals_maximum_and_region_cloud_pass_through():
    spec = ClusterSpec(nodes=2, gpu="H100:8", job_timeout_s=30 * 3600, region="us-east", cloud="oci")
    kwargs = function_kwargs(spec)
    assert kwargs["timeout"] == 24 * 3600 and kwargs["region"] == "us-east" and kwargs["cloud"] == "oci"
    _, fn = ModalBackend().build_function(spec)
    assert inspect_function(fn)["cloud"] == "oci"


@pytest.mark.modal_live
@pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="needs MODAL_TOKEN_ID and a Modal server")
def test_live_smoke_on_modal():
    from modal_rl.cluster.smoke import run_smoke

    report = run_smoke(ClusterSpec(nodes=2, gpu="H100:8", join_timeout_s=600, job_timeout_s=600), "modal")
    assert report["nodes_alive"] == 2 and report["allreduce_ok"] is True, report


def test_plan_for_modal_leaves_addresses_to_the_containers():
    plan = ModalBackend().make_plan(ClusterSpec(nodes=2, gpu="H100:8"), JobRequest(["true"]))
    # Without --dashboard it listens on the head's cluster address only; with it, everywhere
    # in the container, for modal.forward's tunnel.
    assert plan.addresses is None and plan.dashboard_host is None and plan.ray_auth == "token"
    spec = ClusterSpec(nodes=2, gpu="H100:8", dashboard=True)
    assert ModalBackend().make_plan(spec, JobRequest(["true"])).dashboard_host == "0.0.0.0"
    assert (plan.gcs_port, plan.dashboard_port) == (6379, 8265)


@pytest.mark.slow
def test_container_body_runs_the_bootstrap_with_modals_cluster_info(monkeypatch, capsys):
    """The function body every Modal container runs, with only Modal's calls faked.

    ``get_cluster_info`` and ``modal.forward`` need a Modal server; everything behind them
    (plan parsing, the bootstrap, a real one-node Ray head with token auth and its job, the
    returned tail) is real. The run key arrives in the env, as the run's Modal Secret puts it.
    """
    import contextlib
    import sys

    import modal
    import modal.experimental

    from modal_rl.cluster import procs
    from modal_rl.cluster.backend_local import LOOPBACK, free_ports
    from modal_rl.cluster.backend_modal import container_main
    from modal_rl.cluster.raynode import claimed_node_ports

    info = type("Info", (), {"rank": 0, "container_ips": ["fd00::9"], "container_ipv4_ips": [LOOPBACK]})()
    monkeypatch.setattr(modal.experimental, "get_cluster_info", lambda: info)
    forwarded = []

    @contextlib.contextmanager
    def fake_forward(port, **kwargs):
        forwarded.append((port, kwargs))
        yield type("Tunnel", (), {"url": f"https://example.invalid:{port}"})()

    monkeypatch.setattr(modal, "forward", fake_forward)
    job = JobRequest([sys.executable, "-c", "print('hello from the job', flush=True)"])
    plan = ModalBackend().make_plan(
        ClusterSpec(nodes=1, gpu="A10G:1", join_timeout_s=120, dashboard=True), job
    )
    assert plan.ray_auth == "token" and plan.dashboard_host == "0.0.0.0"
    # This machine is shared: other Ray nodes may own Modal's default ports (a container has
    # the host to itself), so the head gets every port claimed, as a local node does.
    plan.gcs_port, plan.dashboard_port, plan.control_port = free_ports(3)
    plan.node_flags, head_env = claimed_node_ports(1, LOOPBACK)
    plan.env.update(head_env)
    plan.dashboard_host = None
    key = new_run_key()
    for name, value in key_env(key).items():  # what the run's Modal Secret sets in the container
        monkeypatch.setenv(name, value)
    saved_env = dict(os.environ)  # the bootstrap sets the node's variables in its own process
    try:
        # A container's /tmp goes with it; here a run dir stands in for it: Ray's node dir and
        # its processes' temp files (they are killed, not asked to exit), removed at the end.
        with run_temp.process_temp() as run_dir:
            plan.temp_root = str(run_dir)
            try:
                result = container_main(plan.to_json())
            finally:
                procs.end_run(plan.run_id)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        # Ray caches the auth mode per process: later in-process Ray tests must see auth off again.
        refresh_ray_auth_cache()
    assert result["rank"] == 0 and result["exit_code"] == 0
    assert any("hello from the job" in line for line in result["tail"])
    assert forwarded == [(plan.dashboard_port, {"unencrypted": False})]  # TLS tunnel
    err = capsys.readouterr().err
    assert "Ray dashboard (token required): https://example.invalid" in err
    assert key not in err and all(key not in line for line in result["tail"])
    assert procs.pids_of_run(plan.run_id) == []
