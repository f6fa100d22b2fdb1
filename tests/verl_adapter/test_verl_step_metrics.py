"""``verl_modal.step_metrics`` in a TaskRunner-like process: after ``install``, verl's own
``Tracking`` (its ``file`` backend, the one metrics.jsonl comes from) logs each training step
with the ``modal_rl/`` numbers the run's other processes left in the parts directory (masks
recorded by ``sample_mask``'s writer, a sandbox reward process's snapshot), per step; a
validation record is left alone. Runs in a child: ``install`` wraps verl's classes for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from omegaconf import OmegaConf
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.utils.tracking import Tracking
    from modal_rl.report.parts import record_mask
    from verl_modal import step_metrics
    from tests._report_runs import sandbox_snapshot

    parts = Path(os.environ["MODAL_RL_RUN_PARTS_DIR"])
    config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": "/nonexistent"}}})
    step_metrics.install(config)
    step_metrics.install(config)  # idempotent: one wrapper
    assert CheckpointEngineManager.update_weights.__wrapped__.__wrapped__ is not None
    tracking = Tracking("p", "e", default_backend=["file"])
    snap = lambda n, errors: (parts / "sandbox-reward-7.json").write_text(
        json.dumps(sandbox_snapshot(n, errors, 0.5 * n, 3, 4)))
    record_mask("sandbox"); record_mask("engine"); snap(4, 1)
    tracking.log({"training/global_step": 1, "critic/score/mean": 0.5}, step=1)
    tracking.log({"val-core/acc": 1.0}, step=1)
    record_mask("sandbox"); snap(10, 1)
    tracking.log({"training/global_step": 2, "critic/score/mean": 0.25}, step=2)
    tracking.finish()
    print("ok")
    """
)


def test_tracking_log_carries_the_parts_numbers_per_step(tmp_path):
    parts, metrics = tmp_path / "parts", tmp_path / "metrics.jsonl"
    parts.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MODAL_RL_RUN_PARTS_DIR": str(parts),
        "VERL_FILE_LOGGER_PATH": str(metrics),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2]
    one, val, two = (r["data"] for r in rows)
    assert one["critic/score/mean"] == 0.5  # verl's own numbers untouched
    assert (
        one["modal_rl/masked/samples"],
        one["modal_rl/masked/sandbox"],
        one["modal_rl/masked/engine"],
    ) == (2, 1, 1)
    assert (two["modal_rl/masked/samples"], two["modal_rl/masked/sandbox"]) == (1, 1)
    assert one["modal_rl/sandbox/samples"] == 4 and two["modal_rl/sandbox/samples"] == 6  # per step
    assert one["modal_rl/sandbox/errors"] == 1 and two["modal_rl/sandbox/errors"] == 0
    assert two["modal_rl/sandbox/lease_wait_s"] == 3.0 and two["modal_rl/sandbox/pool_target"] == 4
    assert one["modal_rl/weight_sync/syncs"] == 0 and "modal_rl/engines/replacements" not in one
    assert not any(k.startswith("modal_rl/") for k in val)
