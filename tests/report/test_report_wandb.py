"""W&B gets modal-rl's numbers as verl's ``wandb`` tracker sends them, checked offline
(``WANDB_MODE=offline``: no account, no network). wandb is not a dependency of modal-rl
(docs/report.md says how to add it); the check skips where it is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs in its own process: wandb starts a service process that ends with that process.
LOG_ONE_STEP = """
from verl.utils.tracking import Tracking
from modal_rl.report import numbers as n
step = {"training/global_step": 1, "actor/pg_loss": 0.25,
        **n.weight_sync([n.SyncRecord(seconds=2.33, full_mib=0.718)])}
tracking = Tracking("modal-rl-check", "offline", default_backend=["wandb"],
                    config={"trainer": {"project_name": "modal-rl-check"}})
tracking.log(step, step=1)
tracking.finish()
"""


@pytest.mark.slow  # wandb's service process takes ~30 s to start and stop here
def test_verls_wandb_backend_keeps_the_modal_rl_numbers_offline(tmp_path):
    # found, not imported: importing wandb makes temp folders in this process
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed (pip install wandb)")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", LOG_ONE_STEP],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    blob = run_file.read_bytes()  # history items are protobuf strings: each key, its JSON value
    for key in ("actor/pg_loss", "modal_rl/weight_sync/sent_mib", "modal_rl/weight_sync/seconds"):
        assert key.encode() in blob, key
    assert b"0.718" in blob and b"2.33" in blob
