"""The run key in plans and specs, offline: made by every launcher, shown only as <redacted>.

The three launchers' ``--dry-run`` run as real subprocesses with a known key exported (so a
leak is a plain substring); Modal functions are built, not deployed, and read back.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.cluster import backend_modal as BM
from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backend_local import LocalBackend, node_command, node_process_env
from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.raynode import node_environment
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError
from modal_rl.run_key import RAY_TOKEN_ENV, REDACTED, RUN_KEY_ENV, ensure_run_key, new_run_key, ray_token
from tests._launcher import ROOT
from tests._slime_lines import glm47_delta, qwen3_4b
from tests.verl_adapter.test_verl_launch import VERL_LINE

# slime's GLM-4.7 line without the paths that must exist on this machine for a local run.
SLIME_LOCAL_LINE = [x for x in glm47_delta() if not x.startswith("/root/")]
SLIME_LOCAL_LINE = [
    x for x in SLIME_LOCAL_LINE if x not in ("--hf-checkpoint", "--ref-load", "--prompt-data")
]
MODAL = ["--backend", "modal", "--nodes", "2", "--gpu", "H100:8"]


def _dry_runs(tmp: Path, key: str) -> dict[str, subprocess.Popen]:
    """Every launcher's --dry-run for both backends, run in parallel (each imports a framework)."""
    entry = tmp / "train.py"
    entry.write_text("")
    cases = {
        "cluster modal": [
            "modal_rl.cluster",
            "run",
            *MODAL,
            "--dry-run",
            "--json",
            "--",
            "python3",
            "train.py",
        ],
        "cluster modal dashboard": [
            "modal_rl.cluster",
            "run",
            *MODAL,
            "--dashboard",
            "--dry-run",
            "--json",
            "--",
            "true",
        ],
        "cluster local": [
            "modal_rl.cluster",
            "run",
            "--nodes",
            "2",
            "--dry-run",
            "--json",
            "--",
            "python3",
            "train.py",
        ],
        "verl modal": [
            "verl_modal",
            *MODAL,
            "--volume",
            "data:/data",
            "--dry-run",
            "--json",
            "--",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=8",
            *VERL_LINE,
        ],
        "verl local cluster": ["verl_modal", "--backend", "local", "--nodes", "2", "--device", "cpu"]
        + ["--tiny", str(tmp / "tiny"), "--dry-run", "--json", "--", "trainer.total_training_steps=1"],
        "slime modal": ["slime_modal", "--backend", "modal", "--gpu", "H100:8", "--data-volume", "d"]
        + ["--dry-run", "--json", "--", *qwen3_4b(root="/data")],
        "slime local": [
            "slime_modal",
            "--backend",
            "local",
            "--nodes",
            "4",
            "--gpu",
            "H100:8",
            "--entry",
            str(entry),
        ]
        + ["--dry-run", "--json", "--", *SLIME_LOCAL_LINE],
    }
    env = {**os.environ, RUN_KEY_ENV: key}  # a user-exported key: the launchers must keep it
    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", RAY_TOKEN_ENV):
        env.pop(name, None)
    return {
        name: subprocess.Popen(
            [sys.executable, "-m", *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in cases.items()
    }


@pytest.mark.slow
def test_dry_runs_of_every_launcher_show_auth_and_never_the_key(tmp_path):
    key = new_run_key()
    results = {name: (p, *p.communicate(timeout=240)) for name, p in _dry_runs(tmp_path, key).items()}
    for name, (proc, out, err) in results.items():
        assert proc.returncode == 0, (name, err[-2000:])
        assert key not in out and key not in err, name
        plan = json.loads(out)
        assert plan["env"][RUN_KEY_ENV].startswith(REDACTED), name  # present, never shown
        modal = plan["backend"] == "modal"
        assert plan["ray_auth"] == ("token" if modal else "disabled"), name
        assert plan["env"]["RAY_AUTH_MODE"] == plan["ray_auth"], name
        if modal:
            assert plan["env"][RAY_TOKEN_ENV].startswith(REDACTED), name
            assert plan["modal_function"]["secrets"][-1] == BM.RUN_SECRET_NOTE, name
            run_secret = plan["modal_function"]["inspected"]["secrets"][-1]
            assert RUN_KEY_ENV in run_secret and RAY_TOKEN_ENV in run_secret, name
            assert plan["dashboard"] == ("tls tunnel, token required" if "dashboard" in name else "off"), name
        else:
            assert plan["dashboard"].startswith("loopback only"), name


def test_launchers_make_a_key_unless_one_is_exported(monkeypatch):
    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    made = ensure_run_key()
    assert len(made) >= 43 and os.environ[RUN_KEY_ENV] == made
    assert ensure_run_key() == made  # one key per run, however often it is asked for
    env = {RUN_KEY_ENV: "exported-by-the-user"}
    assert ensure_run_key(env) == "exported-by-the-user"
    assert ensure_run_key({RUN_KEY_ENV: ""}) != ""


def test_modal_function_carries_the_key_only_in_the_run_secret(monkeypatch):
    key = new_run_key()
    seen = []
    real = BM.modal_secret
    monkeypatch.setattr(BM, "modal_secret", lambda k: seen.append(k) or real(k))
    spec = ClusterSpec(nodes=2, gpu="H100:8", env={"WANDB_PROJECT": "p"}, secrets=("wandb",))
    job = JobRequest(["python3", "train.py"], {"env_vars": {"A": "1"}})
    backend = BM.ModalBackend()
    _, fn = backend.build_function(spec, key=key)
    assert seen == [key]  # the secret made for this run holds this run's key
    secrets = BM.inspect_function(fn)["secrets"]
    assert any(RUN_KEY_ENV in s and RAY_TOKEN_ENV in s for s in secrets) and any(
        "wandb" in s for s in secrets
    )
    plan = backend.make_plan(spec, job)
    text = plan.to_json()  # the function's argument
    assert key not in text and RUN_KEY_ENV not in text and RAY_TOKEN_ENV not in text
    assert plan.ray_auth == "token" and node_environment(plan, "eth0")["RAY_AUTH_MODE"] == "token"
    assert RUN_KEY_ENV not in node_environment(plan, "eth0")  # it becomes the job's (stored) runtime env
    assert BootstrapPlan.from_json(text).ray_auth == "token"


@pytest.mark.parametrize("name", [RUN_KEY_ENV, RAY_TOKEN_ENV, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"])
def test_env_flags_cannot_carry_the_key_or_switch_auth(name):
    with pytest.raises(ClusterSpecError, match="set by the run itself"):
        ClusterSpec(nodes=1, env={name: "x"})


class _Info:
    container_ips = ["fd00::1"]

    def __init__(self, rank):
        self.rank = rank
        self.container_ipv4_ips = ["10.0.0.1", "10.0.0.2"]


@pytest.mark.parametrize(
    ("dashboard", "rank", "tunnel"), [(False, 0, False), (True, 1, False), (True, 0, True)]
)
def test_container_opens_a_tls_tunnel_only_on_rank_0_and_only_with_dashboard(
    monkeypatch, dashboard, rank, tunnel
):
    import modal
    import modal.experimental

    import modal_rl.cluster.bootstrap as bootstrap_module

    forwarded = []

    @contextlib.contextmanager
    def fake_forward(port, **kwargs):
        forwarded.append((port, kwargs))
        yield type("Tunnel", (), {"url": "https://example.invalid"})()

    key = new_run_key()
    monkeypatch.setenv(RUN_KEY_ENV, key)
    monkeypatch.setattr(modal, "forward", fake_forward)
    monkeypatch.setattr(modal.experimental, "get_cluster_info", lambda: _Info(rank))
    monkeypatch.setattr(
        bootstrap_module, "bootstrap", lambda r, a, p, out: print(f"log {key}", file=out) or 0
    )
    spec = ClusterSpec(nodes=2, gpu="H100:8", dashboard=dashboard)
    plan = BM.ModalBackend().make_plan(spec, JobRequest(["true"]))
    result = BM.container_main(plan.to_json())
    assert forwarded == ([(plan.dashboard_port, {"unencrypted": False})] if tunnel else [])
    assert BM.forwards_dashboard(plan, rank) is tunnel
    assert result["tail"] == [f"log {REDACTED}"]  # what rank 0 returns to the launcher is redacted


def test_dashboard_token_goes_to_a_private_file_and_only_its_path_is_printed(monkeypatch, tmp_path):
    key = new_run_key()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(RUN_KEY_ENV, key)
    said = []
    backend = BM.ModalBackend(on_err=said.append)
    plan = backend.make_plan(ClusterSpec(nodes=2, gpu="H100:8", dashboard=True), JobRequest(["true"]))
    backend._announce(plan)
    path = tmp_path / ".modal-rl" / "runs" / f"{plan.run_id}.token"
    assert path.read_text() == ray_token(key)  # Ray's token: derived, never the run key itself
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert (
        len(said) == 1 and str(path) in said[0] and key not in said[0] and "Authorization: Bearer" in said[0]
    )
    said.clear()
    off = backend.make_plan(ClusterSpec(nodes=2, gpu="H100:8"), JobRequest(["true"]))
    backend._announce(off)  # without --dashboard nothing is written or said
    assert said == [] and not (path.parent / f"{off.run_id}.token").exists()


def test_local_nodes_get_the_key_in_their_env_never_their_argv(monkeypatch):
    key = new_run_key()
    monkeypatch.setenv(RUN_KEY_ENV, key)
    monkeypatch.delenv("MODAL_RL_RAY_AUTH", raising=False)
    plan = LocalBackend().make_plan(ClusterSpec(nodes=2), JobRequest(["true"]))
    assert plan.ray_auth == "disabled"  # loopback: off unless asked for
    env = node_process_env(plan)
    assert env[RUN_KEY_ENV] == key and env["RAY_AUTH_MODE"] == "disabled"
    assert key not in " ".join(node_command(Path("/tmp/plan.json"), 1))
    monkeypatch.setenv("MODAL_RL_RAY_AUTH", "token")
    assert LocalBackend().make_plan(ClusterSpec(nodes=2), JobRequest(["true"])).ray_auth == "token"
    monkeypatch.setenv("MODAL_RL_RAY_AUTH", "yes")
    with pytest.raises(ClusterSpecError, match="MODAL_RL_RAY_AUTH"):
        LocalBackend().make_plan(ClusterSpec(nodes=2), JobRequest(["true"]))
