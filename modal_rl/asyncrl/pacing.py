"""Staleness by pacing: admission waits, nothing is discarded, oldest complete groups first.

The trainer consumes ``groups_per_step`` groups per step; before step ``k`` it holds
version ``k`` (step ``k`` makes version ``k + 1``). A group admitted while the engines hold
version ``v`` may be consumed no later than step ``v + max_staleness`` (its *deadline*), so
every sample of it is at most ``max_staleness`` versions behind the trainer that uses it
(``trainer version - start version``; a sample that starts on a newer version than it was
admitted with is only fresher).

How the bound is kept without throwing work away:
- admission (:meth:`StalenessPacer.admit`) accepts a group only if, for every future step
  ``j >= k``, the unconsumed groups due by ``j`` fit in steps ``k .. j``; otherwise the
  caller waits (for a trainer step or a newer engine version) -- a started group is never
  dropped for being stale;
- the trainer (:meth:`StalenessPacer.take`) takes the ``groups_per_step`` *oldest complete*
  groups (by start version, then admission order), so a slow group is not starved by newer
  fast ones; it waits (``take`` returns ``None``) only when taking them would leave more
  groups due by some step than the steps before it can hold -- then it must wait for an
  older group still in flight;
- groups are the unit: a group is admitted, completed and consumed whole, with one start
  version (the admission version), so no group is split across the bound.

Invariants (property-tested): every consumed group has ``step - start_version <=
max_staleness``; every admitted group is consumed once all are complete and enough remain
to fill a step; ``max_staleness = 0`` is synchronous RL (a step's groups all start on the
trainer's current version). Thread-safe: ``admit_wait`` / ``take_wait`` block on one
condition variable.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


class PacingError(ValueError):
    """A misuse of the pacer (unknown group, completed twice, bad settings)."""


@dataclass
class Group:
    seq: int  # admission order
    start_version: int
    deadline: int  # the last step that may consume it
    payload: Any = None
    samples: Any = None
    complete: bool = False
    consumed_at: int | None = None
    admitted_s: float = field(default_factory=time.monotonic)


class StalenessPacer:
    def __init__(self, max_staleness: int, groups_per_step: int, *, step: int = 0) -> None:
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise PacingError(f"max_staleness={max_staleness!r}: a whole number >= 0 (0 is synchronous RL)")
        if not isinstance(groups_per_step, int) or groups_per_step < 1:
            raise PacingError(f"groups_per_step={groups_per_step!r}: a whole number >= 1")
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.step = step  # the trainer's version: the next step to consume
        self._groups: dict[int, Group] = {}  # unconsumed
        self._seq = 0
        self._cond = threading.Condition()
        self.consumed: list[Group] = []  # history, for reports and tests

    # -- admission -------------------------------------------------------------------------
    def _fits(self, deadlines: list[int], from_step: int) -> bool:
        """Whether groups with these deadlines can all be consumed at steps >= ``from_step``,
        ``groups_per_step`` a step, each by its deadline (earliest deadline first)."""
        for n, d in enumerate(sorted(deadlines), start=1):
            if d < from_step or n > (d - from_step + 1) * self.groups_per_step:
                return False
        return True

    def can_admit(self, version: int) -> bool:
        with self._cond:
            return self._can_admit(version)

    def _can_admit(self, version: int) -> bool:
        if version > self.step:
            raise PacingError(f"engine version {version} is ahead of the trainer's {self.step}")
        deadline = version + self.max_staleness
        return self._fits([g.deadline for g in self._groups.values()] + [deadline], self.step)

    def admit(self, version: int, payload: Any = None) -> Group | None:
        """Admit one group that starts on engine version ``version``, or ``None`` when it
        must wait (see the module docstring)."""
        with self._cond:
            if not self._can_admit(version):
                return None
            self._seq += 1
            group = Group(self._seq, version, version + self.max_staleness, payload)
            self._groups[group.seq] = group
            return group

    def admit_wait(self, version_fn, payload: Any = None, timeout: float | None = None) -> Group | None:
        """Block until a group can be admitted at ``version_fn()`` (re-read after every
        trainer step or :meth:`notify`); ``None`` on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                group = self.admit(version_fn(), payload)
                if group is not None:
                    return group
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def notify(self) -> None:
        """Wake waiters (an engine committed a newer version)."""
        with self._cond:
            self._cond.notify_all()

    # -- completion and consumption -----------------------------------------------------
    def complete(self, group: Group, samples: Any = None) -> None:
        with self._cond:
            if self._groups.get(group.seq) is not group:
                raise PacingError(f"group {group.seq} is not an unconsumed group of this pacer")
            if group.complete:
                raise PacingError(f"group {group.seq} completed twice")
            group.samples, group.complete = samples, True
            self._cond.notify_all()

    def in_flight(self) -> int:
        with self._cond:
            return sum(not g.complete for g in self._groups.values())

    def pending(self) -> int:
        with self._cond:
            return len(self._groups)

    def _choice(self) -> list[Group] | None:
        ready = sorted(
            (g for g in self._groups.values() if g.complete), key=lambda g: (g.start_version, g.seq)
        )
        if len(ready) < self.groups_per_step:
            return None
        chosen = ready[: self.groups_per_step]
        taken = {g.seq for g in chosen}
        rest = [g.deadline for g in self._groups.values() if g.seq not in taken]
        if not self._fits(rest, self.step + 1):
            return None  # an older group still in flight is due: wait for it
        return chosen

    def take(self) -> list[Group] | None:
        """The next step's groups (oldest complete first), advancing the trainer's version,
        or ``None`` when it must wait."""
        with self._cond:
            chosen = self._choice()
            if chosen is None:
                return None
            for g in chosen:
                del self._groups[g.seq]
                g.consumed_at = self.step
            self.consumed += chosen
            self.step += 1
            self._cond.notify_all()
            return chosen

    def take_wait(self, timeout: float | None = None) -> list[Group] | None:
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                chosen = self.take()
                if chosen is not None:
                    return chosen
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def staleness(self) -> list[int]:
        """``consumed step - start version`` of every consumed group."""
        with self._cond:
            return [g.consumed_at - g.start_version for g in self.consumed]
