"""A cluster job's driver keeps the run folder the launcher named (``verl_modal.run_report.
run_in_folder``): verl's own ``file`` tracker and rollout dump write into it, and the report
is written there however the run ends. The run itself is stood in for by verl's real
``Tracking`` and its trainer's real generations writer; the full verl run on a cluster is
tests/e2e/test_verl_launch_local_cluster.py's."""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from modal_rl.cluster.run_folder import RUN_COMMAND_ENV, RUN_DIR_ENV
from verl_modal.run_report import run_in_folder


def _config():
    return OmegaConf.create(
        {
            "algorithm": {"adv_estimator": "grpo"},
            "trainer": {"logger": ["console"], "total_training_steps": 2},
        }
    )


def _verl_run(config, env):
    """What verl does with the folder's settings: logs two steps, dumps step 2's samples."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.tracking import Tracking

    os.environ.update(env)  # the TaskRunner's runtime env
    tracking = Tracking("p", "e", default_backend=list(config.trainer.logger))
    for step in (1, 2):
        tracking.log({"training/global_step": step, "actor/pg_loss": 0.5 / step}, step=step)
    RayPPOTrainer._write_generations(["2+2="], [" 4"], ["4"], [1.0], {}, config.trainer.rollout_data_dir, 2)
    del tracking


def test_the_driver_writes_metrics_samples_and_report_into_the_folder(tmp_path, monkeypatch):
    run_dir = tmp_path / "modal-rl-runs" / "verl-x"
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    monkeypatch.setenv(RUN_COMMAND_ENV, "python -m verl_modal --backend modal --gpu H100:8 -- a=1")
    for key in ("VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR"):
        monkeypatch.delenv(key, raising=False)
    config = _config()
    run_in_folder(config, {}, _verl_run)
    assert "file" in config.trainer.logger
    assert config.trainer.rollout_data_dir == str(run_dir / "generations")
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    info = json.loads((run_dir / "run.json").read_text())
    assert info["command"].startswith("python -m verl_modal --backend modal") and info["exit_code"] == 0
    page = (run_dir / "report.html").read_text()
    assert "<td id='fact-exit-status'>finished (exit 0)</td>" in page
    assert "2+2=" in page and "Training: policy loss" in page
    assert not (run_dir / "parts").exists()  # a cluster's other nodes would not be counted


def test_a_failed_run_still_gets_its_end_and_report(tmp_path, monkeypatch):
    run_dir = tmp_path / "verl-y"
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    monkeypatch.delenv(RUN_COMMAND_ENV, raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)

    def fails(config, env):
        _verl_run(config, env)
        raise RuntimeError("an actor died")

    with pytest.raises(RuntimeError, match="an actor died"):
        run_in_folder(_config(), {}, fails)
    info = json.loads((run_dir / "run.json").read_text())
    assert (info["exit_code"], info["status"]) == (1, "failed")
    assert "failed (exit 1)" in (run_dir / "report.html").read_text()


def test_without_a_folder_the_run_is_left_alone(monkeypatch):
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    seen = []
    config = _config()
    run_in_folder(config, {"A": "1"}, lambda cfg, env: seen.append(env))
    assert seen == [{"A": "1"}] and "file" not in config.trainer.logger


def test_a_run_that_fails_before_its_first_step_records_the_failure_and_says_so(tmp_path, monkeypatch):
    from verl_modal.run_report import finish

    run_dir = tmp_path / "verl-z"
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)

    def ray_did_not_start(config, env):
        raise RuntimeError("The current node timed out during startup")

    with pytest.raises(RuntimeError, match="timed out"):
        run_in_folder(_config(), {}, ray_did_not_start)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "failed" and info["command"] and not (run_dir / "report.html").exists()
    assert finish(run_dir) == [("report", "none (no step was logged; run.json says how the run ended)")]
