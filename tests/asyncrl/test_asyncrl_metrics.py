"""A step's ``modal_rl/async/...`` numbers against hand-counted tokens."""

from __future__ import annotations

import pytest

from modal_rl.asyncrl.metrics import PREFIX, step_numbers
from modal_rl.asyncrl.versions import SampleVersions


def test_staleness_is_weighted_by_tokens_and_switches_count_as_fresher():
    got = step_numbers(
        [
            (SampleVersions((3,)), 4, 5),  # 4 tokens, 2 behind
            (SampleVersions((4, 5), (2,)), 6, 5),  # 2 tokens 1 behind, 4 tokens current
            (None, 9, 5),  # no record: counted, in no staleness number
        ],
        engine_idle_s=1.5,
        trainer_wait_s=0.25,
    )
    assert got[PREFIX + "staleness_mean"] == pytest.approx((4 * 2 + 2 * 1 + 4 * 0) / 10)
    assert got[PREFIX + "staleness_max"] == 2.0
    assert got[PREFIX + "staleness_first_max"] == 2.0
    assert got[PREFIX + "versions_per_sample"] == 1.5
    assert (got[PREFIX + "samples"], got[PREFIX + "samples_without_versions"]) == (3.0, 1.0)
    assert (got[PREFIX + "engine_idle_s"], got[PREFIX + "trainer_wait_s"]) == (1.5, 0.25)
    assert all(k.startswith("modal_rl/async/") for k in got)


def test_without_versions_there_is_no_staleness_number_not_a_zero():
    got = step_numbers([(None, 5, 1)])
    assert PREFIX + "staleness_mean" not in got and PREFIX + "staleness_max" not in got
    assert got[PREFIX + "samples_without_versions"] == 1.0
