"""The catch-up rule (``weightsync.catchup``), property-tested against what it promises and
against a brute-force search over every order of retained frames on small cases."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.weightsync.catchup import CannotCatchUp, Held, Retained, catch_up

OLD, NEW = 1, 2  # epochs


@st.composite
def histories(draw):
    """What a server retains: an older epoch's tail, then a newest epoch published as versions
    lo..hi (each an anchor or a delta on the version before it, some with a recovery anchor
    beside their delta), trimmed from the front and with frames possibly lost in between."""
    frames = []
    if draw(st.booleans()):
        frames.append(Retained("anchor", draw(st.integers(0, 12)), OLD, size=draw(st.integers(1, 50))))
    lo = draw(st.integers(0, 4))
    n = draw(st.integers(1, 9))
    for v in range(lo, lo + n):
        kind = "anchor" if v == lo or draw(st.integers(0, 3)) == 0 else "delta"
        size = draw(st.integers(1, 50))
        frames.append(Retained(kind, v, NEW, v - 1 if kind == "delta" else None, size))
        if kind == "delta" and draw(st.integers(0, 3)) == 0:
            recovery = Retained("anchor", v, NEW, None, size + draw(st.integers(0, 60)), recovery=True)
            frames.insert(len(frames) - draw(st.integers(0, 1)), recovery)  # before or after its delta
    start = draw(st.integers(0, len(frames) - 1))
    frames = frames[start:]
    lost = set()
    if len(frames) > 1 and draw(st.booleans()):  # the newest frame is never lost: it is the target
        lost = draw(st.sets(st.integers(0, len(frames) - 2), max_size=2))
    return [f for i, f in enumerate(frames) if i not in lost]


helds = st.one_of(
    st.none(),
    st.builds(Held, st.integers(0, 14), st.sampled_from([OLD, NEW, None, NEW + 1])),
)
bounds = st.one_of(st.none(), st.integers(0, 8))


def _apply(held: Held | None, frames: list[Retained]) -> tuple[int, int] | None:
    """The (epoch, version) a receiver reaches by applying ``frames`` as a chain would, or None
    where one is refused (a delta on a state it was not made from)."""
    at = None if held is None else (held.epoch, held.version)
    for f in frames:
        if f.kind == "delta" and (at is None or at != (f.epoch, f.base)):
            return None
        at = (f.epoch, f.version)
    return at


@settings(max_examples=400, deadline=None)
@given(histories(), helds, bounds)
def test_a_plan_reaches_the_newest_version_and_keeps_every_promise(retained, held, max_deltas):
    plan = catch_up(held, retained, max_deltas=max_deltas)
    newest = max(f.epoch for f in retained)
    target = max(f.version for f in retained if f.epoch == newest)
    if isinstance(plan, CannotCatchUp):
        assert plan.reason
        return
    frames = [retained[i] for i in plan]
    if not frames:  # nothing to send: only to a receiver that holds the target
        assert held == Held(target, newest, held.digest)
        return
    assert all(f.epoch == newest for f in frames)
    assert [f.version for f in frames] == sorted({f.version for f in frames})  # one per version, in order
    first = frames[0]
    assert first.kind == "anchor" or (held is not None and (held.epoch, held.version) == (newest, first.base))
    assert _apply(held, frames) == (newest, target)
    if held is None or held.epoch != newest:  # another epoch, or none named: an anchor first
        assert first.kind == "anchor"
    assert all(f.kind == "delta" for f in frames[1:])  # only the first may be an anchor
    if max_deltas is not None:
        assert sum(f.kind == "delta" for f in frames) <= max_deltas


def _brute_force(held: Held | None, retained: list[Retained], max_deltas: int | None):
    """The lightest of every subsequence of the newest epoch's frames that a chain applies from
    ``held`` to the target, under the bound, of the two shapes a plan may have: every version
    after the receiver's (same epoch), or the newest anchor and every version after it; no
    recovery anchor but first. 0: the receiver holds the target; None: no such plan."""
    newest = max(f.epoch for f in retained)
    ours = [f for f in retained if f.epoch == newest]
    target = max(f.version for f in ours)
    if held is not None and held.epoch == newest and held.version == target:
        return 0
    newest_anchor = max((f.version for f in ours if f.kind == "anchor"), default=None)
    starts = [newest_anchor] if newest_anchor is not None else []
    if held is not None and held.epoch == newest:
        starts.append(held.version)
    best = None
    for r in range(1, len(ours) + 1):
        for combo in itertools.combinations(ours, r):
            frames = sorted(combo, key=lambda f: (f.version, f.recovery))
            versions = [f.version for f in frames]
            if len(set(versions)) != len(frames) or any(f.recovery for f in frames[1:]):
                continue
            if max_deltas is not None and sum(f.kind == "delta" for f in frames) > max_deltas:
                continue
            shaped = (frames[0].kind == "anchor" and versions[0] == newest_anchor) or (
                held is not None and held.epoch == newest and versions[0] > held.version
            )
            every = {f.version for f in ours if f.version > min(versions)}
            if not shaped or set(versions[1:]) != every:
                continue
            if _apply(held, frames) == (newest, target):
                weight = sum(f.size for f in frames)
                best = weight if best is None else min(best, weight)
    return best


@settings(max_examples=300, deadline=None)
@given(histories(), helds, bounds)
def test_the_rule_agrees_with_a_brute_force_search(retained, held, max_deltas):
    """A plan exactly when brute force finds one, and as light as the lightest it finds."""
    newest = max(f.epoch for f in retained)
    target = max(f.version for f in retained if f.epoch == newest)
    plan = catch_up(held, retained, max_deltas=max_deltas)
    if held is not None and held.epoch is not None and (held.epoch, held.version) > (newest, target):
        assert isinstance(plan, CannotCatchUp)  # ahead of what is retained
        return
    best = _brute_force(held, retained, max_deltas)
    if best is None:
        assert isinstance(plan, CannotCatchUp)
    else:
        assert not isinstance(plan, CannotCatchUp)
        assert sum(retained[i].size for i in plan) == best


def test_a_receiver_of_the_served_epoch_gets_the_lighter_path():
    frames = [
        Retained("anchor", 0, NEW, None, 100),
        Retained("delta", 1, NEW, 0, 5),
        Retained("delta", 2, NEW, 1, 5),
        Retained("anchor", 2, NEW, None, 100, recovery=True),
        Retained("delta", 3, NEW, 2, 5),
    ]
    assert catch_up(Held(1, NEW), frames) == [2, 4]  # the deltas after v1
    assert catch_up(Held(1, OLD), frames) == [3, 4]  # another epoch: the newest anchor
    assert catch_up(None, frames) == [3, 4]
    assert catch_up(Held(3, NEW), frames) == []
    assert isinstance(catch_up(Held(4, NEW), frames), CannotCatchUp)  # ahead of what is retained
    assert isinstance(catch_up(Held(1, NEW), frames, max_deltas=0), CannotCatchUp)
    heavy = [f._replace(size=1000) if f.kind == "delta" else f for f in frames]
    assert catch_up(Held(0, NEW), heavy) == [3, 4]  # the deltas weigh more than the anchor path


def test_what_precedes_a_wire_anchor_on_the_way_is_not_sent():
    frames = [
        Retained("anchor", 0, NEW, None, 1),
        Retained("delta", 1, NEW, 0, 1),
        Retained("delta", 2, NEW, 1, 1),
        Retained("anchor", 3, NEW, None, 1),
        Retained("delta", 4, NEW, 3, 1),
        Retained("anchor", 4, NEW, None, 3, recovery=True),
    ]
    assert catch_up(Held(0, NEW), frames) == [3, 4]  # not 1, 2 before the anchor; lighter than v4's


def test_a_delta_whose_base_digest_is_not_the_receivers_is_not_sent():
    frames = [Retained("anchor", 0, NEW, None, 100), Retained("delta", 1, NEW, 0, 5, base_digest="aa")]
    assert catch_up(Held(0, NEW, "aa"), frames) == [1]
    assert catch_up(Held(0, NEW, "bb"), frames) == [0, 1]
    assert isinstance(catch_up(Held(0, NEW), []), CannotCatchUp)
