"""A local verl run's report glue: what the run folder gets before verl starts and after.

Before (:func:`prepare`): ``run.json`` (the config summary and the start facts the report
shows: command line, git commit, versions), verl's rollout dump (``trainer.rollout_data_dir``,
unless the user set it) into ``<run>/generations`` for the report's samples, the parts
directory every process of the run writes its numbers to (``verl_modal.step_metrics``;
the sandbox reward manager's snapshots go there too unless the user named a metrics dir),
and, when ``trainer.logger`` has ``tensorboard`` and ``TENSORBOARD_DIR`` is not set, the
tensorboard event files in ``<run>/tensorboard`` (verl's adapter reads that variable).

After (:func:`finish`): the end facts into ``run.json`` (exit status, wall time), and
``report.html`` (``modal_rl.report``), however the run ended, when
the run (finished or failed, not interrupted) logged at least one step. Never raises: a report that cannot be written is a line
in the summary, not a failed run.
"""

from __future__ import annotations

import os
from pathlib import Path

from modal_rl.report.run_dir import GENERATIONS, TENSORBOARD, write_info, write_outcome
from verl_modal.step_metrics import PARTS_ENV, SANDBOX_ENV

FILE_LOGGER_ENV = "VERL_FILE_LOGGER_PATH"  # verl.utils.tracking.FileLogger

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


def with_file_logger(config, metrics: Path, env_vars: dict[str, str]) -> dict[str, str]:
    """Add verl's ``file`` tracking backend to ``trainer.logger`` (kept: the user's) and point
    it at ``metrics``; returns the env for the run."""
    from omegaconf import ListConfig, OmegaConf

    loggers = config.trainer.logger
    names = list(loggers) if isinstance(loggers, ListConfig | list | tuple) else [str(loggers)]
    if "file" not in names:
        OmegaConf.update(config, "trainer.logger", [*names, "file"], force_add=True)
    return {**env_vars, FILE_LOGGER_ENV: str(metrics)}


def _loggers(config) -> list[str]:
    value = config.trainer.logger
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def prepare(
    config,
    run_dir: Path,
    env: dict[str, str],
    argv: list[str] | None = None,
    *,
    parts: bool = True,
    info: bool = True,
    generations: bool = True,
) -> dict[str, str]:
    """The run's env with the parts (``parts``) and tensorboard dirs added (the user's
    settings win); ``config`` gets ``trainer.rollout_data_dir`` when it has none and the
    trainer can write it (``generations``: ``upstream.dumps_rollouts``). With
    ``info``, ``run.json`` gets the start facts now; ``argv``: the command line the report
    names (default: this process's)."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    if generations and not OmegaConf.select(config, "trainer.rollout_data_dir", default=None):
        OmegaConf.update(config, "trainer.rollout_data_dir", str(run_dir / GENERATIONS), force_add=True)
    if info:
        write_info(run_dir, "verl", config_summary(config), argv)
    out = dict(env)
    if parts:
        folder = run_dir / "parts"
        folder.mkdir(exist_ok=True)
        out[PARTS_ENV] = str(folder)
        if SANDBOX_ENV not in os.environ and SANDBOX_ENV not in env:
            out[SANDBOX_ENV] = str(folder)
    if (
        "tensorboard" in _loggers(config)
        and "TENSORBOARD_DIR" not in os.environ
        and "TENSORBOARD_DIR" not in env
    ):
        out["TENSORBOARD_DIR"] = str(run_dir / TENSORBOARD)
    return out


def finish(run_dir: Path, exit_code: int | None = None, wall_s: float | None = None) -> list[tuple[str, str]]:
    """Record how the run ended (when ``exit_code`` is given) and write the report; the
    summary rows naming it and the tensorboard dir."""
    from modal_rl.report.page import write
    from modal_rl.report.run_dir import METRICS, RUN_INFO, RunDirError, load

    try:
        if exit_code is not None:
            write_outcome(run_dir, exit_code, wall_s or 0.0)
        if not (Path(run_dir) / METRICS).is_file():  # verl ended before its first step
            return [("report", f"none (no step was logged; {RUN_INFO} says how the run ended)")]
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


def run_in_folder(config, env: dict[str, str], run_fn) -> None:
    """A cluster job's driver: ``run_fn(config, env)`` with the run folder of
    :data:`modal_rl.cluster.run_folder.RUN_DIR_ENV` (metrics.jsonl through verl's ``file``
    backend, run.json, generations), then its end facts and report, however verl ended;
    without that variable, just ``run_fn``. The parts folder is not set: a cluster's reward
    and agent-loop processes run on other nodes, whose numbers it would miss."""
    import shlex
    import sys

    from modal_rl.cluster.run_folder import RUN_COMMAND_ENV, RUN_DIR_ENV
    from modal_rl.report.run_dir import recorded

    where = os.environ.get(RUN_DIR_ENV)
    if not where:
        run_fn(config, env)
        return
    run_dir = Path(where)
    run_dir.mkdir(parents=True, exist_ok=True)
    command = os.environ.get(RUN_COMMAND_ENV)
    env = prepare(
        config, run_dir, with_file_logger(config, run_dir / "metrics.jsonl", env), parts=False, info=False
    )

    def run() -> int:
        run_fn(config, env)
        return 0

    # The start and end facts as every launcher records them (slime's too), then the report.
    try:
        recorded(run_dir, "verl", config_summary(config), run, shlex.split(command) if command else None)
    finally:
        for name, value in finish(run_dir):
            print(f"[verl_modal] {name}: {value}", file=sys.stderr, flush=True)
