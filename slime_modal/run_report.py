"""A slime run's ``run.json``: the report's facts (command line, git commit, versions, wall
time, exit status) and a config summary, written by the launcher around the job.

A slime run's folder is the one holding its parts directory (``MODAL_RL_RUN_PARTS_DIR``,
from ``--env`` or the launcher's environment): ``slime_modal.step_metrics`` appends the
run's ``metrics.jsonl`` there, so ``run.json`` beside it makes ``python -m modal_rl.report``
show the same first table as for a verl run. The facts are written by
``modal_rl.report.run_dir.recorded``, the function verl's glue shares.

Invariants: only a run the launcher starts on ``--backend local`` is recorded (on Modal the
folder is a Volume path this machine does not hold); a dry run or preflight writes nothing;
the job's exit code is returned unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from modal_rl.report.parts import PARTS_ENV
from slime_modal.preflight import SlimeArgs

# What the report's config table shows from slime's command line, in this order.
SUMMARY_FLAGS = (
    "--advantage-estimator",
    "--num-rollout",
    "--rollout-batch-size",
    "--n-samples-per-prompt",
    "--global-batch-size",
    "--hf-checkpoint",
    "--lr",
    "--actor-num-nodes",
    "--actor-num-gpus-per-node",
    "--rollout-num-gpus-per-engine",
    "--update-weight-mode",
    "--colocate",
)


def run_folder(job_env: dict[str, str], backend: str) -> Path | None:
    """The run folder of a job started with ``job_env`` (``--env`` values win over this
    process's environment), or None: no parts directory, or not the local backend."""
    parts = job_env.get(PARTS_ENV) or os.environ.get(PARTS_ENV)
    if backend != "local" or not parts:
        return None
    return Path(parts).expanduser().resolve().parent


def config_summary(slime_argv: list[str], launcher: dict[str, object]) -> dict[str, str]:
    """``launcher``'s facts (backend, nodes, entry ...) and the slime flags of
    :data:`SUMMARY_FLAGS` the line gives (a flag without a value reads ``true``)."""
    args = SlimeArgs(slime_argv)
    out = {k: str(v) for k, v in launcher.items() if v is not None}
    for flag in SUMMARY_FLAGS:
        values = args.values(flag)
        if values is not None:
            out[flag.lstrip("-")] = " ".join(values) if values else "true"
    return out


def record(
    folder: Path | None,
    slime_argv: list[str],
    launcher: dict[str, object],
    run: Callable[[], int],
    argv: list[str],
) -> int:
    """``run()``'s exit code; with a ``folder``, its start and end facts go into its ``run.json``
    (``argv``: the launcher's command line, as the report names it)."""
    if folder is None:
        return run()
    from modal_rl.report.run_dir import recorded

    return recorded(folder, "slime", config_summary(slime_argv, launcher), run, argv)
