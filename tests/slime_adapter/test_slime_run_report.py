"""``python -m slime_modal`` records what a run was (command line, git commit, versions, wall
time, exit status) into its run folder's ``run.json``, as verl's launcher does.

The launcher runs in this process up to the cluster: ``modal_rl.cluster.run_job`` is replaced
by a stand-in that runs the job's command (a real entry script, in a real process) and
returns its exit code, so no Ray cluster or slime starts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from modal_rl.report.parts import PARTS_ENV
from modal_rl.report.run_dir import load

LINE = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--lr", "1e-6", "--colocate"]


@pytest.fixture
def launch(tmp_path, monkeypatch):
    from slime_modal.__main__ import main

    monkeypatch.setenv("MODAL_RL_RUN_KEY", "test-run-key-for-the-report")  # restored afterwards
    monkeypatch.delenv(PARTS_ENV, raising=False)
    jobs = []

    def stand_in(spec, command, runtime_env, **kw):
        jobs.append((command, runtime_env, kw))
        if kw.get("dry_run"):
            return 0
        env = {**os.environ, **spec.env}  # as the local backend sets --env on every node
        return subprocess.run(command, env=env, check=False, timeout=60).returncode

    monkeypatch.setattr("modal_rl.cluster.run_job", stand_in)

    def run(entry_code: str, *flags: str) -> tuple[int, list]:
        entry = tmp_path / "train.py"
        entry.write_text(entry_code)
        argv = ["--backend", "local", "--entry", str(entry), *flags, "--", *LINE]
        return main(argv), jobs

    return run


def test_a_local_run_records_start_and_end_facts_beside_its_metrics(tmp_path, launch):
    run_dir = tmp_path / "run"
    # The stand-in job writes one step where slime's step metrics would (the parts' parent).
    step = {"step": 1, "data": {"modal_rl/weight_sync/syncs": 1.0, "train/loss": 0.5}}
    code = (
        "import json, os, pathlib, sys\n"
        "parts = pathlib.Path(os.environ['MODAL_RL_RUN_PARTS_DIR'])\n"
        f"(parts.parent / 'metrics.jsonl').write_text(json.dumps({step!r}) + '\\n')\n"
        "sys.exit(3)\n"
    )
    got, jobs = launch(code, "--env", f"{PARTS_ENV}={run_dir / 'parts'}")
    assert got == 3 and len(jobs) == 1
    assert jobs[0][1]["env_vars"] is not None  # the job got slime's runtime env
    info = json.loads((run_dir / "run.json").read_text())
    assert info["framework"] == "slime"
    assert info["command"].startswith("python") and "-m slime_modal --backend local" in info["command"]
    assert "test-run-key-for-the-report" not in (run_dir / "run.json").read_text()
    assert info["git"] and "modal-rl" in info["versions"]
    assert (info["exit_code"], info["status"]) == (3, "failed") and 0 <= info["wall_s"] < 60
    assert info["ended"] >= info["started"]
    assert info["config"]["backend"] == "local" and info["config"]["lr"] == "1e-6"
    assert info["config"]["colocate"] == "true" and "rollout_engines" not in info["config"]
    assert load(run_dir).info["exit_code"] == 3  # what the report reads


def test_no_parts_folder_or_a_dry_run_writes_nothing(tmp_path, launch, monkeypatch):
    got, _ = launch("import sys; sys.exit(0)\n")
    assert got == 0 and not list(tmp_path.rglob("run.json"))
    got, jobs = launch("", "--env", f"{PARTS_ENV}={tmp_path / 'dry' / 'parts'}", "--dry-run")
    assert got == 0 and jobs[-1][2]["dry_run"] and not (tmp_path / "dry").exists()
    monkeypatch.setenv(PARTS_ENV, str(tmp_path / "from-env" / "parts"))  # the launcher's own env
    got, _ = launch("import sys; sys.exit(0)\n")
    info = json.loads((tmp_path / "from-env" / "run.json").read_text())
    assert got == 0 and (info["exit_code"], info["status"]) == (0, "finished")
