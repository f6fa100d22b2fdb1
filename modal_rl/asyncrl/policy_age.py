"""A trainer's version labels as policy ages: how many optimizer updates the weights held.

A framework labels each weight sync with its step counter, and an engine's ledger records
those labels on every sample. Whether a step's sync comes before or after that step's
optimizer update is the trainer's schedule: a trainer that syncs after its update publishes
``k`` updates under label ``k``; one that syncs before it (generation of the next batch
overlapping this step's training) publishes ``k - 1`` updates under label ``k``, and its
first step publishes the untrained weights twice, under two labels. A label is therefore
not an age, and staleness computed from labels would be off by the schedule.

:class:`UpdateClock` records both events as they happen -- ``updated()`` after each optimizer
update, ``published(label)`` at each sync -- and answers the age of a label (:meth:`age`), the
age of the policy this step's loss is computed against (:meth:`trainer_age`), and a sample's
versions in ages (:meth:`aged`); :meth:`step_samples` hands a step's samples to
``modal_rl.asyncrl.metrics.step_numbers`` in ages, so its staleness counts optimizer updates.

Invariants: ages never decrease along a trainer's labels; a label published twice keeps its
first age (the weights then carried were those the engine got); a label never published has
no age (``None``: its samples count their versions but no staleness, never a guess);
consecutive labels of one sample with the same age are one version (the engine switched to
the same weights), so an aged record still satisfies ``SampleVersions.check``.
"""

from __future__ import annotations

from modal_rl.asyncrl.versions import SampleVersions


class UpdateClock:
    """Optimizer updates and the labels the weights were published under (module doc)."""

    def __init__(self) -> None:
        self.updates = 0
        self._age_of: dict[int, int] = {}
        self._trained_from: int | None = None

    def published(self, label: int) -> None:
        """A sync published the current weights under ``label``."""
        self._age_of.setdefault(int(label), self.updates)

    def updated(self) -> None:
        """One optimizer update finished; the step's loss was computed against the weights
        before it (:meth:`trainer_age`)."""
        self._trained_from = self.updates
        self.updates += 1

    def age(self, label: int) -> int | None:
        return self._age_of.get(int(label))

    def trainer_age(self) -> int:
        """The age of the policy the last step trained (the weights before its update; the
        current weights when no update ran since the last call), then forgets the step."""
        age = self.updates if self._trained_from is None else self._trained_from
        self._trained_from = None
        return age

    def aged(self, versions: SampleVersions) -> SampleVersions | None:
        """``versions`` (labels) in ages, equal neighbours merged; ``None`` when a label was
        never published."""
        ages = [self.age(v) for v in versions.versions]
        if any(a is None for a in ages):
            return None
        kept, switches = [ages[0]], []
        for age, at in zip(ages[1:], versions.switch_at, strict=True):
            if age != kept[-1]:
                kept.append(age)
                switches.append(at)
        return SampleVersions(tuple(kept), tuple(switches))

    def step_samples(
        self, samples: list[tuple[SampleVersions | None, int]]
    ) -> list[tuple[SampleVersions | None, int, int | None]]:
        """A step's ``(versions in labels or None, n_tokens)`` as ``step_numbers`` takes them:
        versions in ages against :meth:`trainer_age` (called once, for the whole step); a
        sample with a label never published keeps its versions and gets no trainer age."""
        trainer = self.trainer_age()
        out: list[tuple[SampleVersions | None, int, int | None]] = []
        for versions, n_tokens in samples:
            aged = None if versions is None else self.aged(versions)
            out.append((aged, n_tokens, trainer) if aged is not None else (versions, n_tokens, None))
        return out
