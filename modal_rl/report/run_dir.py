"""What a run folder holds, as the report reads it.

A run folder (``runs/verl-cpu/logs/<time>/`` for a local verl run; any folder laid out the
same way) has:

- ``metrics.jsonl``: one ``{"step": N, "data": {name: value}}`` per logged step, verl's own
  ``file`` tracking backend format (slime's glue writes the same, ``slime_modal.step_metrics``);
- ``run.json`` (optional): ``{"framework", "config": {name: value}}``, the config summary
  the launcher wrote, with the start facts (``command``, ``git``, ``versions``, ``started``)
  and, once the run is over, the end facts (``exit_code``, ``status``, ``wall_s``, ``ended``):
  :mod:`.provenance`;
- ``generations/<step>.jsonl`` (optional): verl's rollout dump (``trainer.rollout_data_dir``),
  one ``{"input", "output", "score", "step", ...}`` per sample, read by :mod:`.samples`;
- ``parts/engine-events.jsonl`` (optional): the engine supervisors' events, wall-clock ``t``;
- ``tensorboard/`` (optional): the tensorboard event files, when the run logged there.

Invariants: reading never changes the folder; a step logged twice (a resumed run) keeps its
last record; malformed lines are skipped and counted in ``RunData.skipped``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

METRICS = "metrics.jsonl"
RUN_INFO = "run.json"
EVENTS = "parts/engine-events.jsonl"
TENSORBOARD = "tensorboard"
GENERATIONS = "generations"
REPORT = "report.html"


class RunDirError(ValueError):
    """The folder is not a run folder (one line naming the cause and the fix)."""


@dataclass
class RunData:
    path: Path
    steps: dict[int, dict[str, float]]
    info: dict = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    skipped: int = 0

    def series(self, name: str) -> list[tuple[int, float]]:
        """(step, value) for every step that logged ``name``, in step order."""
        return [(s, d[name]) for s, d in sorted(self.steps.items()) if name in d]

    def names(self) -> list[str]:
        return sorted({k for d in self.steps.values() for k in d})

    @property
    def tensorboard(self) -> Path | None:
        tb = self.path / TENSORBOARD
        return tb if tb.is_dir() and any(tb.rglob("events.out.tfevents.*")) else None


def _scalar(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    return None


def _jsonl(path: Path) -> tuple[list[dict], int]:
    rows, bad = [], 0
    if not path.is_file():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def load(path: Path) -> RunData:
    """Read a run folder; :class:`RunDirError` if it has no metrics."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise RunDirError(f"{path} is not a folder; give the run's folder (the one holding {METRICS})")
    if not (path / METRICS).is_file():
        raise RunDirError(
            f"{path} has no {METRICS}; give a run's folder (a local verl run prints it as `metrics` "
            "in its closing summary, under runs/verl-cpu/logs/)"
        )
    rows, skipped = _jsonl(path / METRICS)
    steps: dict[int, dict[str, float]] = {}
    for row in rows:
        data, step = row.get("data"), row.get("step")
        if not isinstance(data, dict) or not isinstance(step, int):
            skipped += 1
            continue
        if "training/global_step" not in data and "modal_rl/weight_sync/syncs" not in data:
            continue  # a validation-only record (verl logs val metrics at the same step)
        steps[step] = {k: v for k, v in ((k, _scalar(v)) for k, v in data.items()) if v is not None}
    info = {}
    if (path / RUN_INFO).is_file():
        try:
            info = json.loads((path / RUN_INFO).read_text())
        except ValueError:
            skipped += 1
    events, bad = _jsonl(path / EVENTS)
    return RunData(path, steps, info if isinstance(info, dict) else {}, events, skipped + bad)


def write_info(run_dir: Path, framework: str, config: dict, argv: list[str] | None = None) -> Path:
    """The launcher's config summary and the run's start facts (``run.json``)."""
    from modal_rl.report.provenance import started

    out = Path(run_dir) / RUN_INFO
    info = {"framework": framework, **started(argv), "config": config}
    out.write_text(json.dumps(info, indent=1, default=str))
    return out


def write_outcome(run_dir: Path, exit_code: int, wall_s: float, status: str | None = None) -> Path:
    """Add the run's end facts to its ``run.json`` (made if missing; an unreadable one is
    replaced by the end facts alone)."""
    from modal_rl.report.provenance import ended

    out = Path(run_dir) / RUN_INFO
    info: dict = {}
    if out.is_file():
        try:
            info = json.loads(out.read_text())
        except ValueError:
            info = {}
    info = {**(info if isinstance(info, dict) else {}), **ended(exit_code, wall_s, status)}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=1, default=str))
    tmp.replace(out)
    return out


def recorded(
    run_dir: Path,
    framework: str,
    config: dict,
    run: Callable[[], int],
    argv: list[str] | None = None,
) -> int:
    """``run()``'s exit code, with the run's start facts written to ``run_dir``'s ``run.json``
    before it (:func:`write_info`) and its end facts after it (:func:`write_outcome`),
    however it ends: an exception is recorded as exit 1 (``failed``) and Ctrl-C as exit 130
    (``interrupted``), then passes through unchanged. The wall time runs from just before
    ``run()`` to just after it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_info(run_dir, framework, config, argv)
    started = time.monotonic()
    code, status = 1, None
    try:
        code = int(run())
    except KeyboardInterrupt:
        code, status = 130, "interrupted"
        raise
    finally:
        write_outcome(run_dir, code, time.monotonic() - started, status)
    return code
