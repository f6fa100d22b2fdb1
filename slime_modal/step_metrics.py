"""Our per-rollout numbers into slime's own logging (its wandb and tensorboard path), under
the same ``modal_rl/`` names verl's runs log (:mod:`modal_rl.report.numbers`).

    --custom-rollout-log-function-path slime_modal.step_metrics.log_rollout_data

slime calls that function, in its rollout manager, with every rollout before it logs the
rollout's own metrics; it returns False, so slime goes on to log them. The numbers go into
slime's ``rollout_extra_metrics`` dict, which slime merges into the rollout's ``log_dict`` and
hands to ``logging_utils.log(args, log_dict, step_key="rollout/step")``: one call of slime's own
logger, so wandb (where ``modal_rl/*`` is bound to ``rollout/step``) and tensorboard get them
at the rollout's step. A rollout without that dict gets its own call of the same logger.

What is known in slime's rollout process:
- weight sync (disk transport): the complete version directories ``weight_vNNNNNN`` under
  ``--update-weight-disk-dir`` published since the previous rollout: ``syncs``, ``sent_mib``
  (their files' size), ``anchors`` (``--update-weight-mode full``) or ``deltas``; the sync
  time is not known here, so slime's runs have no ``weight_sync/seconds``;
- masked samples and sandbox pool numbers from the run's parts directory
  (:mod:`modal_rl.report.parts`), when the launcher set one;
- the policy versions of the rollout's samples (slime's ``Sample.weight_versions``, from
  SGLang's responses), their staleness against the trainer's version and the engines' idle
  seconds before the rollout: ``modal_rl/async/...`` (:mod:`slime_modal.async_numbers`).

With a parts directory, each rollout's numbers are also appended to ``metrics.jsonl`` beside
it (verl's ``file`` backend format), so ``python -m modal_rl.report`` draws slime runs too.

Invariants: never raises into slime (a number we cannot get is left out and logged once);
slime's own metrics are never changed, only ours added.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from modal_rl.report import numbers
from modal_rl.report.parts import PartsReader, parts_dir
from slime_modal import async_numbers

log = logging.getLogger(__name__)
STEP_KEY = "rollout/step"
# Not known in slime's rollout process (the trainer times its own syncs): left out, never 0.
UNKNOWN_HERE = (numbers.WS + "seconds", numbers.WS + "engine_pause_s")


def _without(got: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    return {k: v for k, v in got.items() if k not in names}


def _version_files(vdir: Path) -> float:
    return sum(p.stat().st_size for p in vdir.rglob("*") if p.is_file())


class SlimeCollector:
    """What happened since the previous rollout, in slime's rollout process."""

    def __init__(self, parts: Path | None):
        self.parts = parts
        self.reader = PartsReader(parts)
        self.seen_versions: set[int] = set()
        self.sandbox_before: dict[str, dict] = {}
        self.warned: set[str] = set()
        self.idle = async_numbers.IdleClock()

    def _syncs(self, args) -> list[numbers.SyncRecord]:
        from slime_modal.weight_hooks import complete

        disk = getattr(args, "update_weight_disk_dir", None)
        if not disk or not Path(disk).is_dir():
            return []
        full = getattr(args, "update_weight_mode", "full") != "delta"
        records = []
        for entry in sorted(Path(disk).iterdir()):
            name = entry.name
            if (
                not (name.startswith("weight_v") and name[8:].isdigit())
                or int(name[8:]) in self.seen_versions
            ):
                continue
            if not complete(entry):
                continue  # still being written: counted at the next rollout
            self.seen_versions.add(int(name[8:]))
            mib = _version_files(entry) / (1 << 20)
            sender = {
                "checkpoint_engine/version": float(int(name[8:])),
                "checkpoint_engine/payload_mbytes": mib,
                "checkpoint_engine/anchor": 1.0 if full else 0.0,
            }
            records.append(numbers.SyncRecord(seconds=None, sender=sender))
        return records

    def step(
        self, args, rollout_id: int | None = None, samples: Any = None, rollout_time: float | None = None
    ) -> dict[str, float]:
        """Our numbers for one rollout; ``samples`` and ``rollout_time`` as slime passes them
        to the log function (without them no ``modal_rl/async/...`` numbers)."""
        out: dict[str, float] = {}
        idle = self.idle.idle_before(rollout_time)
        for what, part in (
            ("weight sync", lambda: _without(numbers.weight_sync(self._syncs(args)), UNKNOWN_HERE)),
            ("masks", lambda: numbers.masked(self.reader.new_masks()) if self.parts else {}),  # unseen: no 0
            ("sandboxes", self._sandbox),
            ("versions", lambda: self._versions(args, rollout_id, samples, idle)),
        ):
            try:
                out.update(part())
            except Exception as exc:
                if what not in self.warned:
                    self.warned.add(what)
                    log.warning(
                        "modal_rl step metrics: %s unavailable (%s: %s)", what, type(exc).__name__, exc
                    )
        return out

    @staticmethod
    def _versions(args, rollout_id: int | None, samples: Any, idle: float | None) -> dict[str, float]:
        if rollout_id is None or samples is None:
            return {}
        return async_numbers.rollout_numbers(args, rollout_id, _flat(samples), engine_idle_s=idle)

    def _sandbox(self) -> dict[str, float]:
        now = self.reader.sandbox_snapshots()
        got = numbers.sandbox(self.sandbox_before, now)
        self.sandbox_before = now
        return got

    def write_jsonl(self, step: int, data: dict[str, float]) -> None:
        if self.parts is None:
            return
        try:
            with open(self.parts.parent / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "data": {**data, STEP_KEY: step}}) + "\n")
        except OSError as exc:
            log.warning("modal_rl step metrics: metrics.jsonl not written (%s)", exc)


_collector: SlimeCollector | None = None


def collector() -> SlimeCollector:
    global _collector
    if _collector is None:
        _collector = SlimeCollector(parts_dir())
    return _collector


def _bind_wandb_step(args) -> None:
    if not getattr(args, "use_wandb", False):
        return
    import sys

    wandb = sys.modules.get("wandb")  # slime's logging_utils imported it; we add no dependency
    try:
        if wandb is not None and wandb.run is not None:
            wandb.define_metric(numbers.PREFIX + "*", step_metric=STEP_KEY)
    except Exception as exc:
        log.warning("modal_rl step metrics: wandb step binding failed (%s)", exc)


def _flat(samples: Any) -> list[Any]:
    out: list[Any] = []
    for item in samples or []:
        out.extend(_flat(item) if isinstance(item, list) else [item])
    return out


def sample_means(samples: Any) -> dict[str, float]:
    """The rollout's means as slime names them (reward, response length, the engine's own
    log-probs of the sampled tokens), for ``metrics.jsonl`` and the step line; slime logs its
    own copies into its trackers."""
    flat = _flat(samples)
    rewards = [float(s.reward) for s in flat if isinstance(getattr(s, "reward", None), int | float)]
    lengths = [float(s.response_length) for s in flat if getattr(s, "response_length", None) is not None]
    logps = [float(x) for s in flat for x in (getattr(s, "rollout_log_probs", None) or [])]
    out = {}
    for name, values in (
        ("rollout/raw_reward", rewards),
        ("rollout/response_lengths", lengths),
        ("rollout/rollout_log_probs", logps),
    ):
        if values:
            out[name] = sum(values) / len(values)
    return out


def step_line(rollout_id: int, seen: dict[str, float], ours: dict[str, float]) -> str:
    """One terminal line per rollout (``[modal_rl.step]``, what the CPU main job shows)."""
    parts = [f"[modal_rl.step] rollout {rollout_id}:"]
    for label, key, fmt in (
        ("reward", "rollout/raw_reward", "{:.3f}"),
        ("length", "rollout/response_lengths", "{:.1f}"),
        ("engine logprob", "rollout/rollout_log_probs", "{:.3f}"),
        ("syncs", numbers.WS + "syncs", "{:.0f}"),
        ("sent MiB", numbers.WS + "sent_mib", "{:.3f}"),
        ("sandbox runs", numbers.SB + "execs", "{:.0f}"),
        ("staleness max", async_numbers.PREFIX + "staleness_max", "{:.0f}"),
    ):
        if key in seen or key in ours:
            parts.append(f"{label} " + fmt.format({**seen, **ours}[key]))
    return " ".join(parts)


def log_rollout_data(
    rollout_id: int, args, samples: Any, rollout_extra_metrics: Any, rollout_time: float
) -> bool:
    """slime's custom rollout log function (module docstring); always False: slime logs on."""
    try:
        from slime.observability.metric_utils import compute_rollout_step

        step = int(compute_rollout_step(args, rollout_id))
        col = collector()
        ours = col.step(args, rollout_id, samples, rollout_time)
        _bind_wandb_step(args)
        if isinstance(rollout_extra_metrics, dict):
            rollout_extra_metrics.update(ours)  # slime merges it into the rollout's log_dict
        elif ours:
            from slime.observability import logging_utils

            logging_utils.log(args, {**ours, STEP_KEY: step}, step_key=STEP_KEY)
        seen = sample_means(samples)
        col.write_jsonl(step, {**seen, **ours})
        print(step_line(rollout_id, seen, ours), flush=True)
    except Exception as exc:  # never into slime's rollout loop
        log.warning(
            "modal_rl step metrics: rollout %s not logged (%s: %s)", rollout_id, type(exc).__name__, exc
        )
    return False
