"""One step's asynchronous-RL numbers as flat ``modal_rl/async/...`` scalars.

Framework-neutral: a trainer (``asyncrl.loop``, an adapter's step hook) hands the samples
it trains on this step -- each sample's versions (``SampleVersions`` or ``None`` when the
engine kept no record), its token count and the trainer's version -- plus the engine idle
and trainer wait seconds it measured, and gets scalars for its tracker and our report:

- ``staleness_mean`` / ``staleness_max``: token-weighted: every token counts
  ``trainer version - the version that made it`` (a sample that switched versions mid-way
  counts its later tokens as fresher), averaged over and maxed over tokens;
- ``staleness_first_max``: the largest ``trainer version - first version`` over samples
  (what a start-version bound such as ``StalenessPacer``'s caps);
- ``versions_per_sample``: the mean number of versions a sample's tokens came from;
- ``samples``, ``samples_without_versions``: samples trained on, and those with no record
  (counted, never given a guessed version);
- ``engine_idle_s``, ``trainer_wait_s``: as measured by the caller.

Invariants: tokens of samples without versions are in no staleness number; with no token
that has a version the staleness keys are absent (not 0); names start with ``PREFIX``.
"""

from __future__ import annotations

from collections.abc import Iterable

from modal_rl.asyncrl.versions import SampleVersions

PREFIX = "modal_rl/async/"


def step_numbers(
    samples: Iterable[tuple[SampleVersions | None, int, int | None]],
    *,
    engine_idle_s: float | None = None,
    trainer_wait_s: float | None = None,
) -> dict[str, float]:
    """``samples``: ``(versions, n_tokens, trainer_version)`` per sample of the step; a
    trainer version of ``None`` (not known to the caller) counts the sample's versions but
    puts it in no staleness number."""
    n = without = tokens = 0
    lag_sum = 0
    lag_max: int | None = None
    first_max: int | None = None
    versions_sum = 0
    for versions, n_tokens, trainer in samples:
        n += 1
        if versions is None:
            without += 1
            continue
        versions_sum += len(versions.versions)
        if trainer is None:
            continue
        first = trainer - versions.first
        first_max = first if first_max is None else max(first_max, first)
        bounds = (0, *versions.switch_at, max(int(n_tokens), 0))
        for version, a, b in zip(versions.versions, bounds, bounds[1:], strict=False):
            if b <= a:
                continue
            lag = trainer - version
            lag_sum += lag * (b - a)
            tokens += b - a
            lag_max = lag if lag_max is None else max(lag_max, lag)
    out = {PREFIX + "samples": float(n), PREFIX + "samples_without_versions": float(without)}
    if n > without:
        out[PREFIX + "versions_per_sample"] = versions_sum / (n - without)
    if first_max is not None:
        out[PREFIX + "staleness_first_max"] = float(first_max)
    if tokens:
        out[PREFIX + "staleness_mean"] = lag_sum / tokens
        out[PREFIX + "staleness_max"] = float(lag_max)
    if engine_idle_s is not None:
        out[PREFIX + "engine_idle_s"] = float(engine_idle_s)
    if trainer_wait_s is not None:
        out[PREFIX + "trainer_wait_s"] = float(trainer_wait_s)
    return out
