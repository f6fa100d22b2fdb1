"""A slime rollout's ``modal_rl/async/...`` numbers, from the versions slime already records.

slime's ``Sample.weight_versions`` lists, for each of a sample's engine responses, the
``weight_version`` SGLang reported in its ``meta_info``: the version slime's own weight path
gave that engine (``/update_weights_from_disk`` and our catch-up both pass slime's count).
That is the version contract's "every sample carries the versions its tokens came from",
kept by SGLang and slime; this module turns it into the same numbers verl's runs log
(:mod:`modal_rl.asyncrl.metrics`).

The trainer's version for rollout ``r`` -- the newest version it has published when it
trains on ``r`` -- follows from the entry's loop (:data:`LOOPS`). Both of slime's mains call
``update_weights`` once before the first rollout, then ``train.py`` after every step and
``train_async.py`` after every ``--update-weights-interval``-th step. That first call publishes
version ``start + 1`` (``start``: slime's ``args.update_weight_start_version``, 0 on a fresh run),
except in slime's disk delta mode, where it only captures the engines' start weights as the
base the first delta applies to: there the base is version ``start`` and the first delta
``start + 1``. So the trainer's version is ``start + first + (r - start_rollout_id) //
interval`` with ``first`` 1, or 0 in delta mode. For an entry not in :data:`LOOPS` the
staleness keys are left out (the counts and ``versions_per_sample`` are still logged).

``engine_idle_s``: the seconds between the end of the previous rollout and the start of this
one (slime's rollout manager runs one ``generate`` at a time and passes its duration to the
log function), the time the engines served no rollout.

Invariants: SGLang labels an engine's start weights ``"default"``; in delta mode those are
the base version ``start`` (slime's delta is made against them), otherwise no sample is made
before slime's first push relabels them, and ``"default"`` or any other label that is not
slime's integer count gives the sample no version (counted in ``samples_without_versions``,
never guessed). A sample whose responses came from several
versions (a multi-turn or resumed sample across an update) is counted in
``samples_mixed_versions`` and all its tokens are charged to its oldest version, since slime
does not record where in the sample the switch fell: its staleness is then an upper bound.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from modal_rl.asyncrl.metrics import PREFIX, step_numbers
from modal_rl.asyncrl.versions import SampleVersions

ENTRY_ENV = "MODAL_RL_SLIME_ENTRY"
# slime's mains and how many steps pass between their weight pushes (read from slime's args).
LOOPS: dict[str, Callable[[Any], int]] = {
    "train.py": lambda args: 1,  # pushes after every step; --update-weights-interval is not read
    "train_async.py": lambda args: max(int(getattr(args, "update_weights_interval", 1) or 1), 1),
}
START_LABEL = "default"  # SGLang's weight_version for the weights an engine started with


def _start(args: Any) -> int:
    return int(getattr(args, "update_weight_start_version", 0) or 0)


def base_is_start_weights(args: Any) -> bool:
    """slime's disk delta mode: the first ``update_weights`` publishes nothing, the engines'
    start weights are the base version (module docstring)."""
    return getattr(args, "update_weight_transport", None) == "disk" and (
        getattr(args, "update_weight_mode", "full") == "delta"
    )


def trainer_version(args: Any, rollout_id: int, entry: str | None) -> int | None:
    """The version slime's trainer has published when it trains on ``rollout_id`` (module
    docstring); ``None`` for an entry whose loop is not in :data:`LOOPS`."""
    interval = LOOPS.get(os.path.basename(entry or ""))
    if interval is None:
        return None
    first = 0 if base_is_start_weights(args) else 1
    first_rollout = int(getattr(args, "start_rollout_id", 0) or 0)
    return _start(args) + first + (rollout_id - first_rollout) // interval(args)


def sample_versions(sample: Any, args: Any = None) -> tuple[SampleVersions | None, int]:
    """``(versions, how many distinct versions its responses came from)`` of one slime sample
    (module invariants: ``"default"`` is the base only in delta mode; several versions are
    charged to the oldest)."""
    seen: list[int] = []
    for raw in getattr(sample, "weight_versions", None) or []:
        text = str(raw)
        if text == START_LABEL and args is not None and base_is_start_weights(args):
            seen.append(_start(args))
            continue
        if not text.isdigit():
            return None, 0
        seen.append(int(text))
    if not seen:
        return None, 0
    return SampleVersions((min(seen),)), len(set(seen))


class IdleClock:
    """Engine idle seconds between slime's rollouts, from the log calls' times (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.previous_end: float | None = None

    def idle_before(self, rollout_time: float | None) -> float | None:
        now = self.clock()
        started = now - float(rollout_time) if rollout_time is not None else None
        idle = None
        if started is not None and self.previous_end is not None:
            idle = max(started - self.previous_end, 0.0)
        self.previous_end = now
        return idle


def rollout_numbers(
    args: Any,
    rollout_id: int,
    samples: Iterable[Any],
    *,
    entry: str | None = None,
    engine_idle_s: float | None = None,
) -> dict[str, float]:
    """The rollout's ``modal_rl/async/...`` scalars (module docstring); ``entry`` defaults to
    ``$MODAL_RL_SLIME_ENTRY``, which the launcher sets to the job's script."""
    entry = os.environ.get(ENTRY_ENV) if entry is None else entry
    trainer = trainer_version(args, rollout_id, entry)
    rows, distinct = [], []
    for sample in samples:
        versions, count = sample_versions(sample, args)
        rows.append((versions, int(getattr(sample, "response_length", 0) or 0)))
        if versions is not None:
            distinct.append(count)
    out = step_numbers([(v, n, trainer) for v, n in rows], engine_idle_s=engine_idle_s)
    if trainer is not None:
        out[PREFIX + "trainer_version"] = float(trainer)
    out[PREFIX + "samples_mixed_versions"] = float(sum(c > 1 for c in distinct))
    if distinct:  # each sample's own count, not the one version it is charged to
        out[PREFIX + "versions_per_sample"] = sum(distinct) / len(distinct)
    return out
