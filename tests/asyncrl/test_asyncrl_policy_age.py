"""Version labels become policy ages (optimizer updates) whichever side of the update a
trainer syncs on, so staleness counts updates, not labels."""

from __future__ import annotations

from modal_rl.asyncrl.metrics import PREFIX, step_numbers
from modal_rl.asyncrl.policy_age import UpdateClock
from modal_rl.asyncrl.versions import SampleVersions


def staleness_max(clock: UpdateClock, label: int) -> float:
    got = step_numbers(clock.step_samples([(SampleVersions((label,)), 4)]))
    return got[PREFIX + "staleness_max"]


def test_syncing_before_the_update_is_one_step_off_after_the_first_step():
    """verl's one-step-off schedule: sync label 0 at the start; step k syncs label k (the
    weights of k - 1 updates) before training on the batch generated under label k - 1."""
    clock = UpdateClock()
    clock.published(0)
    got = []
    for k in (1, 2, 3, 4):
        clock.published(k)  # the step's sync, before its update
        clock.updated()
        got.append(staleness_max(clock, k - 1))  # the batch generated before this sync
    assert got == [0.0, 1.0, 1.0, 1.0]
    assert (clock.age(0), clock.age(1), clock.age(2)) == (0, 0, 1)


def test_syncing_after_the_update_makes_labels_ages():
    clock = UpdateClock()
    clock.published(0)
    for k in (1, 2, 3):
        clock.updated()
        clock.published(k)
        assert clock.age(k) == k
    assert clock.trainer_age() == 2  # the last step trained the weights before its update
    assert clock.trainer_age() == 3  # no update since: the current weights


def test_labels_of_the_same_weights_merge_and_unknown_labels_get_no_age():
    clock = UpdateClock()
    clock.published(0)
    clock.published(1)  # the same weights again, under a new label
    clock.updated()
    clock.published(2)
    # a sample switched 0 -> 1 (no change of weights) -> 2 at tokens 3 and 5
    assert clock.aged(SampleVersions((0, 1, 2), (3, 5))) == SampleVersions((0, 1), (5,))
    assert clock.aged(SampleVersions((7,))) is None
    rows = clock.step_samples([(SampleVersions((7,)), 4), (None, 0), (SampleVersions((1,)), 3)])
    # never published: versions kept, no trainer age (in no staleness number); no record stays None
    assert rows == [(SampleVersions((7,)), 4, None), (None, 0, None), (SampleVersions((0,)), 3, 0)]
    got = step_numbers(rows)
    assert got[PREFIX + "samples_without_versions"] == 1.0
    assert got[PREFIX + "versions_per_sample"] == 1.0
    assert (got[PREFIX + "staleness_mean"], got[PREFIX + "staleness_max"]) == (0.0, 0.0)
