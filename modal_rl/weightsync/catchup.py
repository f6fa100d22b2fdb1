"""The catch-up rule: which retained frames bring a receiver from what it holds to the newest.

One pure function, ``catch_up``, decides this for every place that serves a receiver that
fell behind, connected late or restarted: a chain's ``frames_since`` and ``rebuild``, a frame
server's retention (``transport.retention.kept_since``), a store's reader
(``DirectoryStore.plan``) and a collective receiver choosing which broadcast frame to decode
(``transport.collective``: the rule over that one frame). Each describes what it retains as
``Retained`` records and maps the indices it gets back to its own frames (records, bytes,
files).

Invariants of a plan (the indices ``catch_up`` returns):
- only frames of the newest retained epoch are planned; the plan's frames are in increasing
  version order and end at that epoch's newest version (the target);
- it starts with an anchor, or with a delta whose base is the version the receiver holds in
  that epoch (and, where both are known, whose base digest is the receiver's); every later
  delta's base is the version the frame before it reached, so applying the plan in order
  reaches the target;
- it takes one frame per version, and only its first frame may be an anchor (what precedes an
  anchor is never needed): a recovery anchor is sent only to start from;
- a receiver of another epoch (older, or one it does not name) is sent an anchor first: a
  delta of one epoch never lands on a state of another;
- of the two possible plans — the frames after the receiver's version, from the last anchor
  among them if any ("warm"), and the newest anchor with the deltas after it ("cold") — the
  lighter is taken, warm on a tie (``size``); a plan with more than ``max_deltas`` deltas is
  never taken;
- the empty plan means the receiver already holds the target; every other situation in which
  nothing can be sent (nothing retained, the receiver ahead of what is retained, no anchor
  and no delta following the receiver, a gap, or only plans over the bound) is a
  ``CannotCatchUp`` with its reason, never a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple


class Retained(NamedTuple):
    """What a server or store retains of one frame, as far as the rule needs it.

    ``base``: a delta's base version (None for an anchor, or a delta whose base is unknown,
    which then never follows anything); ``base_digest``: a delta's digest of its base's
    tensor checksums (None: unknown, not compared); ``size``: what sending it costs (bytes; 0 when the
    caller does not weigh); ``recovery``: an anchor kept for catch-up only, beside the delta
    of its version."""

    kind: Literal["anchor", "delta"]
    version: int
    epoch: int
    base: int | None = None
    size: int = 0
    recovery: bool = False
    base_digest: str | None = None


class Held(NamedTuple):
    """What a receiver holds: ``version`` of ``epoch`` (None: it does not say which epoch, so
    its version is not trusted as the base of any delta) and the digest of its tensor
    checksums (``wire.frames.state_digest``; None: unknown, not compared)."""

    version: int
    epoch: int | None
    digest: str | None = None


class CannotCatchUp(NamedTuple):
    """No plan brings the receiver to the target; ``reason`` says why (for logs)."""

    reason: str


def catch_up(
    held: Held | None, retained: Sequence[Retained], *, max_deltas: int | None = None
) -> list[int] | CannotCatchUp:
    """Indices into ``retained`` of the frames to send, in order (see the module invariants),
    to a receiver holding ``held`` (None: nothing); or why there are none."""
    if not retained:
        return CannotCatchUp("nothing is retained")
    epoch = max(f.epoch for f in retained)
    frames = [i for i, f in enumerate(retained) if f.epoch == epoch]
    target = max(retained[i].version for i in frames)
    if held is not None and held.epoch is not None and (held.epoch, held.version) > (epoch, target):
        return CannotCatchUp(
            f"the receiver holds v{held.version} of epoch {held.epoch:x}, newer than anything retained "
            f"(v{target} of epoch {epoch:x})"
        )
    same_epoch = held is not None and held.epoch == epoch
    if same_epoch and held.version == target:
        return []
    # One frame per version for the frames that follow a start: the delta or wire anchor,
    # else a recovery anchor (its delta is gone).
    step: dict[int, int] = {}
    for i in frames:
        v = retained[i].version
        if v not in step or retained[step[v]].recovery:
            step[v] = i
    plans: list[list[int]] = []
    if same_epoch:
        warm = _follow(retained, step, held.version, [], held.digest)
        if warm is not None:  # what precedes an anchor on the way is not needed
            anchored = [k for k, i in enumerate(warm) if retained[i].kind == "anchor"]
            plans.append(warm[anchored[-1] :] if anchored else warm)
    anchors = [i for i in frames if retained[i].kind == "anchor"]
    if anchors:
        newest = max(anchors, key=lambda i: (retained[i].version, not retained[i].recovery))
        cold = _follow(retained, step, retained[newest].version, [newest])
        if cold is not None:
            plans.append(cold)
    if not plans:
        return CannotCatchUp(
            f"no anchor of epoch {epoch:x} and no delta after the receiver's version leads to v{target}"
            if not anchors
            else f"a frame between the newest anchor and v{target} is missing"
        )
    bounded = [p for p in plans if max_deltas is None or _deltas(retained, p) <= max_deltas]
    if not bounded:
        return CannotCatchUp(f"every path to v{target} takes more than {max_deltas} deltas")
    return min(bounded, key=lambda p: sum(retained[i].size for i in p))  # first (warm) on a tie


def _follow(
    retained: Sequence[Retained], step: dict[int, int], start: int, plan: list[int], digest: str | None = None
) -> list[int] | None:
    """``plan`` extended by the frame of each version after ``start`` (whose state's digest is
    ``digest`` when known); None where a delta's base is not the version reached before it (a
    gap, or a base the receiver does not hold)."""
    at = start
    for v in sorted(x for x in step if x > start):
        f = retained[step[v]]
        if f.kind == "delta" and (f.base != at or (at == start and _differ(f.base_digest, digest))):
            return None
        plan.append(step[v])
        at = v
    return plan


def _differ(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and a != b


def _deltas(retained: Sequence[Retained], plan: list[int]) -> int:
    return sum(retained[i].kind == "delta" for i in plan)
