"""The policy-version contract, against a ground truth: a simulated engine decodes tokens for
interleaved requests while versions are committed between its steps; every finished
sample's record must name, for each token, the version that was committed when that token
was made."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.asyncrl.versions import (
    BASE_VERSION,
    SampleVersions,
    VersionContractError,
    VersionLedger,
    VersionTooOldError,
    require,
)

# An engine's life: start a request, decode one step (every live request makes a token),
# commit the next version, or finish a live request.
ACTIONS = st.lists(
    st.sampled_from(["start", "step", "step", "step", "commit", "finish"]), min_size=1, max_size=120
)


@settings(max_examples=150, deadline=None)
@given(ACTIONS, st.integers(0, 2**16))
def test_every_token_is_labelled_with_the_version_that_made_it(actions, seed):
    import random

    rng = random.Random(seed)
    ledger = VersionLedger()
    truth: dict[str, list[int]] = {}  # req -> the committed version at each of its tokens
    served = BASE_VERSION
    n = 0
    for action in actions:
        live = ledger.live()
        if action == "start":
            n += 1
            ledger.start(f"r{n}")
            truth[f"r{n}"] = []
        elif action == "step":
            for req in live:
                truth[req].append(served)
        elif action == "commit":
            served += rng.randint(1, 3)  # a version may be skipped (an engine that missed one)
            switched = ledger.commit(served, {req: len(truth[req]) for req in live})
            assert switched <= len(live)
            assert ledger.committed == served
        elif action == "finish" and live:
            req = rng.choice(live)
            tokens = truth.pop(req)
            record = ledger.finish(req, len(tokens))
            assert record.check(max(len(tokens), 1)) is record
            if tokens:
                assert record.per_token(len(tokens)) == tokens
                assert [record.version_of(i) for i in range(len(tokens))] == tokens
                assert record.first == tokens[0] and record.last == tokens[-1]
                assert len(record.versions) == len(set(tokens))
    _, records = ledger.finished_since(0)
    assert len(records) == n - len(ledger.live())


def test_a_commit_mid_generation_is_one_switch_at_the_first_new_token():
    ledger = VersionLedger(committed=3)
    ledger.start("a")
    assert ledger.commit(4, {"a": 5}) == 1
    ledger.start("b")  # starts on 4
    ledger.commit(5, {"a": 7, "b": 0})  # b has no token yet: it starts on 5
    a, b = ledger.finish("a", 9), ledger.finish("b", 2)
    assert a == SampleVersions((3, 4, 5), (5, 7))
    assert b == SampleVersions((5,), ())
    assert a.to_json() == {"versions": [3, 4, 5], "switch_at": [5, 7]}
    assert SampleVersions.from_json(a.to_json(), 9) == a
    assert a.staleness(6) == 3


def test_a_commit_after_the_last_token_is_not_a_switch():
    ledger = VersionLedger(committed=0)
    ledger.start("a")
    ledger.commit(1, {"a": 4})  # the request made its last token, then the commit landed
    assert ledger.finish("a", 4) == SampleVersions((0,), ())


def test_versions_only_move_forward_and_every_live_request_is_counted():
    ledger = VersionLedger(committed=2)
    with pytest.raises(VersionContractError, match="only move forward"):
        ledger.commit(2, {})
    ledger.start("a")
    with pytest.raises(VersionContractError, match="missing"):
        ledger.commit(3, {})
    with pytest.raises(VersionContractError, match="twice"):
        ledger.start("a")


@pytest.mark.parametrize(
    "record, n, cause",
    [
        ({"versions": []}, 3, "empty"),
        ({"versions": [2, 1], "switch_at": [1]}, 3, "strictly increase"),
        ({"versions": [1, 2], "switch_at": []}, 3, "switch indices"),
        ({"versions": [1, 2], "switch_at": [3]}, 3, "inside"),
        ({"versions": [1, 2], "switch_at": [0]}, 3, "inside"),
        ({"versions": [1, "2"], "switch_at": [1]}, 3, "integers"),
        ("v3", 3, "object"),
    ],
)
def test_malformed_records_are_refused_with_one_clear_cause(record, n, cause):
    with pytest.raises(VersionContractError, match=cause):
        SampleVersions.from_json(record, n)


def test_a_request_may_require_a_minimum_version():
    require(5, None)
    require(5, 5)
    with pytest.raises(VersionTooOldError, match="requires >= 6"):
        require(5, 6)


def test_finished_records_are_read_by_cursor_and_bounded():
    ledger = VersionLedger(committed=0, retain=3)
    for i in range(5):
        ledger.start(f"r{i}")
        ledger.finish(f"r{i}", 1)
    seq, records = ledger.finished_since(0)
    assert seq == 5 and [r for r, _ in records] == ["r2", "r3", "r4"]  # the oldest two are gone
    assert ledger.finished_since(seq) == (5, [])


def test_finalize_drops_commits_after_the_last_token():
    from modal_rl.asyncrl.versions import finalize

    live = {"versions": [2, 3, 4], "switch_at": [4, 9]}  # read while the engine still held it
    assert finalize(live, 9) == SampleVersions((2, 3), (4,))
    assert finalize(live, 10) == SampleVersions((2, 3, 4), (4, 9))
    assert finalize(live, 0) == SampleVersions((2,))


def test_engine_request_ids_map_back_to_the_clients():
    from modal_rl.asyncrl.engine_client import _request_of

    assert _request_of("cmpl-mrl0123abcd-0-1a2b3c4d") == "mrl0123abcd"
    assert _request_of("chatcmpl-x-0-1a2b3c4d") is None
    assert _request_of("cmpl-short") is None


def test_the_parts_of_a_sample_join_into_one_record():
    from modal_rl.asyncrl.versions import joined

    parts = [
        {"versions": [3, 4], "switch_at": [5], "tokens": 8},
        {"versions": [4], "switch_at": [], "tokens": 2},  # resumed on the version it ended on
        {"versions": [5, 6], "switch_at": [1], "tokens": 4},
    ]
    assert joined(parts) == {"versions": [3, 4, 5, 6], "switch_at": [5, 10, 11], "tokens": 14}
    assert joined([]) == {"versions": [], "switch_at": [], "tokens": 0}


def test_the_ledger_counts_the_seconds_it_held_no_request():
    now = [100.0]
    ledger = VersionLedger(committed=0, clock=lambda: now[0])
    now[0] = 130.0
    assert ledger.idle_seconds() == 0.0  # before the first request nothing is idle time
    ledger.start("a")
    ledger.start("b")
    now[0] = 140.0
    ledger.finish("a", 3)  # "b" still runs: busy
    now[0] = 145.0
    ledger.finish("b", 3)
    now[0] = 147.5
    assert ledger.idle_seconds() == 2.5  # an open idle stretch counts up to now
    ledger.commit(1, {})  # a commit with nothing live does not end the stretch
    now[0] = 150.0
    ledger.start("c")
    now[0] = 160.0
    assert ledger.idle_seconds() == 5.0
    ledger.restart(0, epoch=2)  # "c" runs on across the restart without a record: still busy
    now[0] = 170.0
    assert ledger.idle_seconds() == 5.0
    ledger.forget("c")
    now[0] = 171.0
    assert ledger.idle_seconds() == 6.0
    ledger.start("d")
    ledger.discard("d")  # ended without a record
    now[0] = 172.0
    assert ledger.idle_seconds() == 7.0
