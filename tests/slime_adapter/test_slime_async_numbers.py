"""slime's sample versions into ``modal_rl/async/...``: the trainer's version follows the
entry's loop, unpublished weights give no version, several versions are charged to the oldest."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime_modal import async_numbers as A

P = A.PREFIX


def _sample(versions: list[str], n: int = 4) -> SimpleNamespace:
    return SimpleNamespace(weight_versions=versions, response_length=n)


@pytest.mark.parametrize(
    ("entry", "interval", "expected"),
    [
        ("train.py", 3, [1, 2, 3, 4, 5]),  # train.py pushes after every step whatever the flag says
        ("train_async.py", 1, [1, 2, 3, 4, 5]),
        ("train_async.py", 2, [1, 1, 2, 2, 3]),
        ("/abs/slime/train_async.py", 2, [1, 1, 2, 2, 3]),
        ("examples/fully_async/train.py", 1, [1, 2, 3, 4, 5]),  # named by its basename
        ("my_loop.py", 1, [None] * 5),
    ],
)
def test_the_trainer_version_follows_the_entrys_loop(entry, interval, expected):
    args = SimpleNamespace(
        update_weights_interval=interval, start_rollout_id=0, update_weight_start_version=0
    )
    assert [A.trainer_version(args, r, entry) for r in range(5)] == expected


def test_a_resumed_run_counts_from_its_start():
    args = SimpleNamespace(update_weights_interval=1, start_rollout_id=10, update_weight_start_version=7)
    assert A.trainer_version(args, 10, "train.py") == 8 and A.trainer_version(args, 12, "train.py") == 10


def test_staleness_is_token_weighted_against_the_trainer_version():
    args = SimpleNamespace(update_weights_interval=1, start_rollout_id=0)
    out = A.rollout_numbers(args, 3, [_sample(["4"], 6), _sample(["2"], 2)], entry="train_async.py")
    assert out[P + "trainer_version"] == 4.0
    assert out[P + "staleness_max"] == 2.0 and out[P + "staleness_mean"] == pytest.approx(2 * 2 / 8)
    assert out[P + "samples"] == 2.0 and out[P + "samples_without_versions"] == 0.0


def test_unpublished_weights_and_missing_records_give_no_version():
    args = SimpleNamespace()
    out = A.rollout_numbers(args, 0, [_sample(["default"]), _sample([]), _sample(["1"])], entry="train.py")
    assert out[P + "samples_without_versions"] == 2.0
    assert out[P + "staleness_max"] == 0.0  # only the sample made by version 1 counts


def test_a_sample_across_an_update_is_charged_to_its_oldest_version():
    versions, count = A.sample_versions(_sample(["3", "5", "5"]))
    assert versions.versions == (3,) and count == 2
    out = A.rollout_numbers(SimpleNamespace(), 5, [_sample(["3", "5"]), _sample(["6"])], entry="train.py")
    assert out[P + "staleness_max"] == 3.0 and out[P + "samples_mixed_versions"] == 1.0
    assert out[P + "versions_per_sample"] == 1.5


def test_an_unknown_loop_logs_versions_but_no_staleness():
    out = A.rollout_numbers(SimpleNamespace(), 2, [_sample(["1"]), _sample(["1", "2"])], entry="mine.py")
    assert not any(k.startswith(P + "staleness") for k in out) and P + "trainer_version" not in out
    assert out[P + "versions_per_sample"] == 1.5 and out[P + "samples"] == 2.0


def test_the_entry_comes_from_the_launchers_variable(monkeypatch):
    monkeypatch.setenv(A.ENTRY_ENV, "train_async.py")
    out = A.rollout_numbers(SimpleNamespace(update_weights_interval=2), 4, [_sample(["1"])])
    assert out[P + "trainer_version"] == 3.0 and out[P + "staleness_max"] == 2.0


def test_idle_is_the_gap_between_one_rollouts_end_and_the_next_ones_start():
    now = iter([10.0, 25.0, 26.0])
    clock = A.IdleClock(clock=lambda: next(now))
    assert clock.idle_before(8.0) is None  # rollout 0: 2 s -> 10 s
    assert clock.idle_before(12.0) == 3.0  # rollout 1: 13 s -> 25 s, after 3 s idle
    assert clock.idle_before(5.0) == 0.0  # overlapping measurements never go negative


def test_in_disk_delta_mode_the_start_weights_are_the_base_version():
    # slime's first update_weights in disk delta mode captures the engines' start weights
    # (SGLang's "default") as the base the first delta applies to: version 0 of a fresh run
    args = SimpleNamespace(update_weight_transport="disk", update_weight_mode="delta")
    assert [A.trainer_version(args, r, "train_async.py") for r in range(3)] == [0, 1, 2]
    rollouts = [[_sample(["default"])], [_sample(["default"])], [_sample(["1"])]]
    stale = [
        A.rollout_numbers(args, r, s, entry="train_async.py")[P + "staleness_max"]
        for r, s in enumerate(rollouts)
    ]
    assert stale == [0.0, 1.0, 1.0]
    full = SimpleNamespace(update_weight_transport="disk", update_weight_mode="full")
    assert A.sample_versions(_sample(["default"]), full) == (None, 0)  # relabelled before any rollout
