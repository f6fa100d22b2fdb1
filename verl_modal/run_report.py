"""A local verl run's report glue: what the run folder gets before verl starts and after.

Before (:func:`prepare`): ``run.json`` (the config summary the report shows), the parts
directory every process of the run writes its numbers to (``verl_modal.step_metrics``;
the sandbox reward manager's snapshots go there too unless the user named a metrics dir),
and, when ``trainer.logger`` has ``tensorboard`` and ``TENSORBOARD_DIR`` is not set, the
tensorboard event files in ``<run>/tensorboard`` (verl's adapter reads that variable).

After (:func:`finish`): ``report.html`` (``modal_rl.report``), however the run ended, when
the run (finished or failed, not interrupted) logged at least one step. Never raises: a report that cannot be written is a line
in the summary, not a failed run.
"""

from __future__ import annotations

import os
from pathlib import Path

from modal_rl.report.run_dir import TENSORBOARD, write_info
from verl_modal.step_metrics import PARTS_ENV, SANDBOX_ENV

# What the report's config table shows (verl's key -> its label).
SUMMARY_KEYS = (
    "algorithm.adv_estimator",
    "trainer.total_training_steps",
    "trainer.v1.trainer_mode",
    "data.train_batch_size",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.checkpoint_engine.backend",
    "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.actor.optim.lr",
    "reward.reward_manager.name",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.logger",
)


def config_summary(config) -> dict[str, str]:
    from omegaconf import OmegaConf

    out = {}
    for key in SUMMARY_KEYS:
        value = OmegaConf.select(config, key, default=None)
        if value is not None:
            out[key] = str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
    return out


def _loggers(config) -> list[str]:
    value = config.trainer.logger
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def prepare(config, run_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """The run's env with the parts and tensorboard dirs added (the user's settings win)."""
    run_dir = Path(run_dir)
    write_info(run_dir, "verl", config_summary(config))
    parts = run_dir / "parts"
    parts.mkdir(exist_ok=True)
    out = {**env, PARTS_ENV: str(parts)}
    if SANDBOX_ENV not in os.environ and SANDBOX_ENV not in env:
        out[SANDBOX_ENV] = str(parts)
    if (
        "tensorboard" in _loggers(config)
        and "TENSORBOARD_DIR" not in os.environ
        and "TENSORBOARD_DIR" not in env
    ):
        out["TENSORBOARD_DIR"] = str(run_dir / TENSORBOARD)
    return out


def finish(run_dir: Path) -> list[tuple[str, str]]:
    """Write the report; the summary rows naming it and the tensorboard dir."""
    from modal_rl.report.page import write
    from modal_rl.report.run_dir import RunDirError, load

    try:
        run = load(run_dir)
        if not run.steps:
            rows = [("report", "none (no step was logged)")]
        else:
            rows = [("report", str(write(run_dir)))]
        tb = run.tensorboard
    except (RunDirError, Exception) as exc:  # a report failure must not fail a finished run
        return [("report", f"not written: {type(exc).__name__}: {exc}")]
    rows.append(("tensorboard", str(tb) if tb else "none (trainer.logger has no tensorboard)"))
    return rows
