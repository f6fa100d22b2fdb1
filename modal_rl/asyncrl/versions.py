"""The policy-version contract: which committed weight version made each token of a sample.

An engine serves exactly one committed version at a time (``VersionLedger.committed``); a
new version is committed between two decoding steps, never during one. Every returned sample
carries a :class:`SampleVersions`: the versions its tokens came from, in order, and the index
of the first token of each later version. A sample that saw no commit has one version and no
switch; one that saw a commit mid-generation has ``versions == (v0, v1)`` and
``switch_at == (i,)``: tokens ``[0, i)`` came from ``v0``, tokens ``[i, n)`` from ``v1``.

``BASE_VERSION`` (-1) names the weights an engine was started with, before any version was
committed to it. A request may require a minimum version (``require``): an engine that holds
less does not serve it (the caller waits for a commit, it is not refused work).

Invariants (checked by :meth:`SampleVersions.check`, and kept by :class:`VersionLedger`):
- ``versions`` strictly increase and ``len(switch_at) == len(versions) - 1``;
- ``switch_at`` strictly increase, each in ``[1, n_tokens)``: every listed version made at
  least one token of the sample (a commit after the last token is not a switch of it; a
  commit before the first token means the sample started on the newer version);
- the ledger's ``committed`` only increases within a publisher epoch; a commit at or below
  it is refused. A new publisher numbering from 0 again is a :meth:`VersionLedger.restart`:
  visible (``restarts``, ``epoch`` on every later record), and no record spans it.

This module is plain Python: the engine side (``weightsync.apply.vllm_versions``) and every
framework adapter use the same bookkeeping.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

BASE_VERSION = -1
DEFAULT_RETAIN = 65536  # finished records an engine keeps for late readers


class VersionContractError(ValueError):
    """A version record that breaks the contract (see the module invariants)."""


class VersionTooOldError(RuntimeError):
    """The engine holds an older version than a request requires; wait for a commit."""


@dataclass(frozen=True)
class SampleVersions:
    versions: tuple[int, ...]
    switch_at: tuple[int, ...] = ()

    @property
    def first(self) -> int:
        return self.versions[0]

    @property
    def last(self) -> int:
        return self.versions[-1]

    @property
    def switched(self) -> bool:
        return len(self.versions) > 1

    def check(self, n_tokens: int) -> SampleVersions:
        """``self`` when it satisfies the module invariants for ``n_tokens`` tokens;
        ``VersionContractError`` naming the broken one otherwise."""
        v, s = self.versions, self.switch_at
        if not v:
            raise VersionContractError("a sample's versions are empty: every sample has a first version")
        if any(not isinstance(x, int) or isinstance(x, bool) for x in (*v, *s)):
            raise VersionContractError(f"versions and switch indices must be integers, got {v} / {s}")
        if len(s) != len(v) - 1:
            raise VersionContractError(f"{len(v)} versions need {len(v) - 1} switch indices, got {len(s)}")
        if any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise VersionContractError(f"versions must strictly increase, got {v}")
        bounds = (0, *s, n_tokens)
        if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
            raise VersionContractError(
                f"switch indices {s} must strictly increase inside (0, {n_tokens}): each version makes a token"
            )
        return self

    def version_of(self, token: int) -> int:
        """The version that made token ``token`` (0-based)."""
        if token < 0:
            raise IndexError(f"token index {token} < 0")
        i = 0
        while i < len(self.switch_at) and token >= self.switch_at[i]:
            i += 1
        return self.versions[i]

    def per_token(self, n_tokens: int) -> list[int]:
        """One version per token (for token-level importance weights or masks)."""
        out: list[int] = []
        bounds = (0, *self.switch_at, n_tokens)
        for version, a, b in zip(self.versions, bounds, bounds[1:], strict=False):
            out += [version] * (b - a)
        return out

    def staleness(self, trainer_version: int) -> int:
        """How many versions behind ``trainer_version`` the sample started."""
        return trainer_version - self.first

    def to_json(self) -> dict:
        return {"versions": list(self.versions), "switch_at": list(self.switch_at)}

    @classmethod
    def from_json(cls, data: object, n_tokens: int) -> SampleVersions:
        """Parse and check a record from an engine (one clear error when it is malformed)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("versions"), list):
            raise VersionContractError(
                f"a version record is a {{versions, switch_at}} object, got {data!r:.200}"
            )
        return cls(tuple(data["versions"]), tuple(data.get("switch_at") or ())).check(n_tokens)


def finalize(record: object, n_tokens: int) -> SampleVersions:
    """The checked record of a sample that ended with ``n_tokens`` tokens: switches at or
    after its last token (commits that landed after it ended) are dropped."""
    if not isinstance(record, Mapping) or not isinstance(record.get("versions"), list | tuple):
        raise VersionContractError(
            f"a version record is a {{versions, switch_at}} object, got {record!r:.200}"
        )
    versions, switch_at = list(record["versions"]), list(record.get("switch_at") or ())
    while switch_at and len(versions) > 1 and switch_at[-1] >= n_tokens:
        switch_at.pop()
        versions.pop()
    return SampleVersions(tuple(versions), tuple(switch_at)).check(max(n_tokens, 1))


def joined(records: list[Mapping]) -> dict:
    """One sample's record from the records of its parts, in order (a trajectory generated in
    several answers, each with ``versions``, ``switch_at`` and ``tokens``): the parts' versions
    one after the other, a switch where a part starts on another version than the one before
    ended; ``tokens`` is the sum."""
    versions: list = []
    switch_at: list[int] = []
    offset = 0
    for rec in records:
        bounds = [0, *rec["switch_at"]]
        for version, at in zip(rec["versions"], bounds, strict=True):
            if not versions or version != versions[-1]:
                if versions:
                    switch_at.append(offset + int(at))
                versions.append(version)
        offset += int(rec["tokens"])
    return {"versions": versions, "switch_at": switch_at, "tokens": offset}


def require(committed: int, min_version: int | None) -> None:
    """``VersionTooOldError`` when an engine holding ``committed`` must not serve a request
    that requires ``min_version``."""
    if min_version is not None and committed < min_version:
        raise VersionTooOldError(
            f"the engine holds version {committed}, the request requires >= {min_version}; "
            "commit a newer version to it (or lower the requirement)"
        )


class VersionLedger:
    """The engine side of the contract: one committed version at a time, and for every live
    request the versions its tokens came from. The engine calls :meth:`start` when a request
    is first scheduled, :meth:`commit` between decoding steps (with every live request's
    token count), and :meth:`finish` with the final count; finished records are kept (the
    last ``retain``) for :meth:`finished_since`.

    Idle time: :meth:`idle_seconds` is how long, since its first request started, the engine
    held no live request (``clock`` seconds; a request running across a restart still
    counts as live until it ends). It only grows, so a reader takes differences."""

    def __init__(
        self,
        committed: int = BASE_VERSION,
        retain: int = DEFAULT_RETAIN,
        epoch: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.committed = committed
        self.commits = 0
        self.epoch = epoch  # the publisher's epoch of ``committed`` (None: not known)
        self.restarts = 0
        self._dropped: set[str] = set()  # running across a restart: no record, ever
        self._live: dict[str, tuple[list[int], list[int]]] = {}
        self._done: OrderedDict[int, tuple[str, dict]] = OrderedDict()
        self._seq = 0
        self._retain = retain
        self._clock = clock
        self._idle_s = 0.0
        self._idle_since: float | None = None  # None: busy, or no request started yet
        self.ident = uuid.uuid4().hex[:12]  # tells this ledger's counters from a replacement's

    def live(self) -> list[str]:
        return list(self._live)

    def idle_seconds(self) -> float:
        """Seconds with no live request since the first request started (0 before it)."""
        ongoing = self._clock() - self._idle_since if self._idle_since is not None else 0.0
        return self._idle_s + max(ongoing, 0.0)

    def _busy_changed(self) -> None:
        """Close or open an idle stretch after the live set changed (only requests change
        it, so nothing is idle time before the first one)."""
        busy = bool(self._live or self._dropped)
        if busy and self._idle_since is not None:
            self._idle_s += max(self._clock() - self._idle_since, 0.0)
            self._idle_since = None
        elif not busy and self._idle_since is None:
            self._idle_since = self._clock()

    def start(self, req_id: str) -> None:
        if req_id in self._dropped:
            return  # it ran across a restart: its tokens' versions are not comparable
        if req_id in self._live:
            raise VersionContractError(f"request {req_id!r} started twice")
        self._live[req_id] = ([self.committed], [])
        self._busy_changed()

    def commit(self, version: int, tokens: Mapping[str, int]) -> int:
        """Make ``version`` the served version; ``tokens``: how many tokens each live request
        has so far (all made by the versions before). Returns how many live requests saw the
        switch mid-generation."""
        if version <= self.committed:
            raise VersionContractError(
                f"version {version} is not above the committed {self.committed}: versions only move forward"
            )
        missing = [r for r in self._live if r not in tokens]
        if missing:
            raise VersionContractError(
                f"a commit needs the token count of every live request; missing {missing[:3]}"
            )
        switched = 0
        for req_id, (versions, switch_at) in self._live.items():
            n = int(tokens[req_id])
            if n <= (switch_at[-1] if switch_at else 0):
                versions[-1] = version  # no token of the previous version yet: it starts on this one
            else:
                versions.append(version)
                switch_at.append(n)
                switched += 1
        self.committed = version
        self.commits += 1
        return switched

    def restart(self, version: int, epoch: int | None) -> int:
        """A new publisher (``epoch``) numbering its versions afresh: ``version`` is served
        now, whatever its number. Versions of two epochs are not comparable, so every live
        request loses its record (``finished_since`` never reports it: absent, not wrong) and
        requests started from now on are recorded in the new epoch. Returns how many
        records were dropped."""
        dropped = list(self._live)
        self._dropped.update(dropped)
        self._live.clear()
        self.committed, self.epoch = int(version), epoch
        self.restarts += 1
        self.commits += 1
        return len(dropped)

    def forget(self, req_id: str) -> None:
        """A request that ran across a restart ended: stop remembering it."""
        if req_id in self._dropped:
            self._dropped.discard(req_id)
            self._busy_changed()

    def discard(self, req_id: str) -> None:
        """A live request ended without a record (its record could not be made)."""
        if self._live.pop(req_id, None) is not None:
            self._busy_changed()

    def live_records(self) -> list[tuple[str, dict]]:
        """Every live request's record so far (for a caller that knows a request ended
        before the engine reported it: :func:`finalize` with its token count)."""
        return [(r, {"versions": list(v), "switch_at": list(s)}) for r, (v, s) in self._live.items()]

    def finish(self, req_id: str, n_tokens: int) -> SampleVersions:
        versions, switch_at = self._live.pop(req_id)
        self._busy_changed()
        record = finalize({"versions": versions, "switch_at": switch_at}, n_tokens)
        self._seq += 1
        stored = record.to_json() if self.epoch is None else {**record.to_json(), "epoch": self.epoch}
        self._done[self._seq] = (req_id, stored)
        while len(self._done) > self._retain:
            self._done.popitem(last=False)
        return record

    def finished_since(self, seq: int) -> tuple[int, list[tuple[str, dict]]]:
        """Records finished after sequence number ``seq``, and the sequence to ask from next."""
        return self._seq, [rec for s, rec in self._done.items() if s > seq]
