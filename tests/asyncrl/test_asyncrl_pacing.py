"""Staleness by pacing, under random schedules: groups admitted on lagging engine versions,
completed in random order; the trainer takes whenever it may. The bound holds for every
consumed group, nothing admitted is dropped, the oldest complete groups go first, and
``max_staleness=0`` is synchronous."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.asyncrl.pacing import PacingError, StalenessPacer

SCHEDULES = st.tuples(
    st.integers(0, 3),  # max_staleness
    st.integers(1, 4),  # groups per step
    st.integers(0, 2**16),  # seed
    st.integers(4, 12),  # trainer steps to reach
)


def drive(max_staleness: int, per_step: int, seed: int, steps: int) -> StalenessPacer:
    """Random admissions (engine lag 0..2 versions), completions and takes until ``steps``
    steps are consumed; checks each take's choice against the complete groups."""
    rng = random.Random(seed)
    pacer = StalenessPacer(max_staleness, per_step)
    groups = []
    engine = 0
    for _ in range(100_000):
        if pacer.step >= steps:
            return pacer
        engine = max(engine, pacer.step - rng.randint(0, 2))
        action = rng.random()
        if action < 0.4:
            g = pacer.admit(engine)
            if g is not None:
                assert pacer.step - g.start_version <= max_staleness
                groups.append(g)
        elif action < 0.8:
            open_ = [g for g in groups if not g.complete and g.consumed_at is None]
            if open_:
                pacer.complete(rng.choice(open_), samples=seed)
        else:
            ready = sorted(
                (g for g in groups if g.complete and g.consumed_at is None),
                key=lambda g: (g.start_version, g.seq),
            )
            taken = pacer.take()
            if taken is not None:
                assert len(taken) == per_step
                assert taken == ready[:per_step]  # the oldest complete groups first
        if pacer.pending() and not pacer.in_flight() and pacer.pending() >= per_step:
            assert pacer._choice() is not None  # all complete: the trainer never waits
    raise AssertionError("the schedule did not reach its steps (a deadlock)")


@settings(max_examples=150, deadline=None)
@given(SCHEDULES)
def test_no_consumed_group_is_staler_than_the_bound(schedule):
    max_staleness = schedule[0]
    pacer = drive(*schedule)
    assert pacer.consumed
    assert all(s <= max_staleness for s in pacer.staleness())
    assert all(g.consumed_at <= g.deadline for g in pacer.consumed)


@settings(max_examples=100, deadline=None)
@given(SCHEDULES)
def test_nothing_admitted_is_dropped_and_groups_are_taken_whole(schedule):
    max_staleness, per_step, seed, steps = schedule
    pacer = drive(*schedule)
    # Finish what is in flight: every admitted group is consumed while a step can be filled.
    for g in list(pacer._groups.values()):
        if not g.complete:
            pacer.complete(g)
    while pacer.pending() >= per_step:
        assert pacer.take() is not None
    seqs = [g.seq for g in pacer.consumed]
    assert len(seqs) == len(set(seqs))  # each group once, whole
    assert set(seqs) | {g.seq for g in pacer._groups.values()} == set(range(1, pacer._seq + 1))
    assert all(s <= max_staleness for s in pacer.staleness())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**16))
def test_zero_staleness_is_synchronous(per_step, seed):
    pacer = drive(0, per_step, seed, 6)
    assert pacer.staleness() and set(pacer.staleness()) == {0}


def test_a_slow_old_group_holds_the_trainer_instead_of_being_starved():
    pacer = StalenessPacer(1, 1)
    slow = pacer.admit(0)  # due by step 1
    fast = pacer.admit(0)
    assert pacer.admit(0) is None  # a third would not fit by step 1: admission waits
    pacer.complete(fast)
    assert pacer.take() == [fast]  # step 0 takes the complete one
    newer = pacer.admit(1)
    pacer.complete(newer)
    assert pacer.take() is None  # step 1 must take the slow group: the trainer waits for it
    pacer.complete(slow)
    assert pacer.take() == [slow]
    assert pacer.take() == [newer]
    assert pacer.staleness() == [0, 1, 1]


def test_an_engine_too_far_behind_waits_for_a_commit():
    pacer = StalenessPacer(1, 1, step=5)
    assert not pacer.can_admit(3)  # it would be 2 versions stale at best
    assert pacer.can_admit(4)
    with pytest.raises(PacingError, match="ahead of the trainer"):
        pacer.can_admit(6)


def test_waiters_wake_on_a_trainer_step():
    pacer = StalenessPacer(0, 1)
    first = pacer.admit(0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pacer.admit_wait(lambda: pacer.step, timeout=10)))
    waiter.start()
    pacer.complete(first)
    assert pacer.take_wait(timeout=10) == [first]
    waiter.join(10)
    assert got and got[0] is not None and got[0].start_version == 1


@pytest.mark.parametrize("bad", [(-1, 1), (1, 0), (1.5, 1)])
def test_bad_settings_name_the_fix(bad):
    with pytest.raises(PacingError, match="whole number"):
        StalenessPacer(*bad)
