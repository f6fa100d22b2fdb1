"""Real verl runs that several test files check, each run once per session.

- ``main_job``: ``scripts/main.sh``'s command, ``python -m verl_modal --backend local --tiny DIR
  -- trainer.total_training_steps=3 'trainer.logger=[console,tensorboard]'`` (a real verl 0.9.1
  GRPO run on this CPU, ~3 min here), checked by tests/e2e/test_verl_cpu_run.py (the launcher's
  output, the steps, the weight sync) and tests/e2e/test_report_verl_run.py (tensorboard, report);
- ``sandboxed_job``: the same with ``--tiny-task code`` for 2 steps: every response scored in
  bubblewrap sandboxes by the ``modal_sandbox`` reward manager (found through this checkout's
  ``verl.plugins`` entry point), its counters reaching the run's parts folder; checked by
  tests/e2e/test_verl_sandbox_cpu_run.py (no sandbox leaks, the reward's counters) and
  tests/e2e/test_report_verl_run.py (the pool per step, drawn).

CI pays for each run once. A failed run fails every test that uses it, with the launcher's
lines and verl's log tail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MAIN_STEPS = 3
SANDBOXED_STEPS = 2


@dataclass
class Job:
    code: int
    ours: list[str]  # the launcher's own lines
    log: str  # everything printed, then verl's log
    logs_dir: Path  # --log-dir; the run's folder is its one entry
    leaked: list[dict] = field(default_factory=list)  # sandboxes still alive after the run

    @property
    def run_dir(self) -> Path:
        (run_dir,) = self.logs_dir.iterdir()
        return run_dir


def _run(tmp: Path, extra: list[str], overrides: list[str], extra_env: dict | None = None) -> Job:
    from tests.e2e.test_verl_cpu_run import run_launcher

    ours: list[str] = []
    code, log = run_launcher(
        [
            "--backend",
            "local",
            "--tiny",
            str(tmp / "tiny"),
            *extra,
            "--log-dir",
            str(tmp / "logs"),
            "--",
            *overrides,
        ],
        timeout=1400,
        extra_env=extra_env,
        terminal=ours,
    )
    return Job(code, ours, log, tmp / "logs")


def _check(job: Job) -> Job:
    # The launcher's own lines name the cause (a killed engine, OOM); verl's log tail shows where.
    assert job.code == 0, "\n".join(job.ours[-30:]) + "\n--- verl's log, last lines ---\n" + job.log[-4000:]
    return job


@pytest.fixture(scope="session")
def main_job(tmp_path_factory) -> Job:
    overrides = [f"trainer.total_training_steps={MAIN_STEPS}", "trainer.logger=[console,tensorboard]"]
    return _check(_run(tmp_path_factory.mktemp("main-job"), [], overrides))


@pytest.fixture(scope="session")
def sandboxed_job(tmp_path_factory) -> Job:
    from modal_rl.sandboxes import live_records
    from tests.verl_plugin_helpers import plugin_env

    tmp = tmp_path_factory.mktemp("sandboxed-job")
    sandboxes = tmp / "sandbox-registry"
    extra_env = {
        "PYTHONPATH": plugin_env(tmp / "plugins")["PYTHONPATH"],  # this checkout's entry points
        "MODAL_RL_SANDBOX_REGISTRY": str(sandboxes),
        "MODAL_RL_RUN_ID": f"verl-sandbox-test-{os.getpid()}",
    }
    try:
        job = _run(
            tmp, ["--tiny-task", "code"], [f"trainer.total_training_steps={SANDBOXED_STEPS}"], extra_env
        )
        job.leaked = leaked(sandboxes)
    finally:
        live_records.sweep(sandboxes, {"run": extra_env["MODAL_RL_RUN_ID"]})  # whatever happened above
    return _check(job)


def leaked(registry_dir) -> list[dict]:
    """Registered sandboxes of the run whose process is still alive (same PID and start time)."""
    from modal_rl.sandboxes import live_records

    return [
        e
        for e in live_records.entries(registry_dir)
        if e.get("starttime") is not None and live_records.proc_starttime(int(e["pid"])) == e["starttime"]
    ]
