"""Subscriber: the rollout side of weight sync.

The subscriber fetches the next frame, rebuilds and verifies it into its staging state (a
``VersionChain``) while the engine keeps serving the live weights, and only then calls the
activation callback — the framework's weight loader — which is the only moment the engine
has to pause.

Invariants:
- the live weights change only inside ``activate(staged_state, version)``, and only to a
  version whose every tensor matched the publisher's checksum;
- a refused frame (stale, out of order, wrong base, corrupt, truncated) changes neither the
  live weights nor the staging state; the subscriber records the error, drops the
  connection and asks again for what it lacks (catch-up from the last anchor if needed); a
  staged state that an audit (every ``audit_every_s``, a full sum between frames) finds
  damaged is replaced the same way, from the next anchor;
- after a restart the subscriber starts empty and catches up from the last anchor;
- what it holds is ordered by ``(epoch, version)`` (``epoch``): a newer epoch's anchor
  replaces it whatever the version, an older epoch's frames are refused; ``status()`` says
  which run, epoch and version are live and since when (the chaos benchmark reads it);
- frames are verified with the source's key (``source.keys``: signed frames only, every
  record's MAC checked before it is used; a source without ``keys`` means the run's key
  from the environment); a source that fails its handshake, or refuses a file of its own
  (a store's planted, unsigned or rolled-back file), counts as a refusal;
- no version older than one this receiver has seen signed is ever activated: not below its
  own (the chain refuses it), and not below a ``floor_version`` (of ``floor_epoch``, when
  given) passed in — e.g. the version a signed pull named. Frames below the floor on the way
  up to it (an anchor and its deltas) are staged but not activated; frames of an epoch older
  than ``floor_epoch`` are refused; a store whose ``latest`` is below the floor is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modal_rl.weightsync.chain import VersionChain
from modal_rl.weightsync.codec.dtypes import words_of
from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.errors import FrameInterruptedError, VersionNotReachedError, WeightSyncError
from modal_rl.weightsync.transport.base import FrameSource
from modal_rl.weightsync.wire.auth import FROM_ENV

log = logging.getLogger(__name__)

Activate = Callable[[dict[str, Any], int], None]


@dataclass
class SyncTiming:
    version: int
    kind: str
    bytes: int
    fetch_s: float
    decode_s: float  # rebuild into staging, verification included
    verify_s: float  # of decode_s: hashing the rebuilt tensors (summed over threads)
    activate_s: float  # the engine pause
    activated_at: float  # time.time() when activation finished
    epoch: int = 0  # the epoch of the activated version


@dataclass
class Subscriber:
    source: FrameSource
    activate: Activate
    config: CodecConfig = field(default_factory=CodecConfig)
    chain: VersionChain = field(init=False)
    timings: list[SyncTiming] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    live_version: int | None = None
    live_epoch: int | None = None
    started_at: float = field(default_factory=time.time)
    floor_version: int | None = None  # never activate a version below it (see the invariants)
    floor_epoch: int | None = None  # ... of this epoch; without it, by version number alone
    target_epoch: int | None = None  # the epoch a signed pull names (``vllm_extension``)
    # Deltas are verified by the sums their changes moved; every this many seconds the held
    # state is also summed in full, between frames (``VersionChain.audit``). None: never.
    audit_every_s: float | None = 600.0
    last_audit: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.chain = VersionChain(self.config, retain=False, key=self.source.keys)
        from modal_rl.weightsync.codec.warmup import start_warm_up

        # the decoder's kernels load now, while the anchor is on the wire, not on the first
        # delta; and this CPU's decode costs are measured for the hello (``decode_costs``)
        start_warm_up(self.config.threads, measure_costs=True)

    @property
    def floor(self) -> tuple[int | None, int] | None:
        """``(floor_epoch, floor_version)``, or None without a floor."""
        if self.floor_version is None and self.floor_epoch is None:
            return None
        return (self.floor_epoch, self.floor_version or 0)

    def _below_floor(self, epoch: int, version: int) -> bool:
        floor = self.floor
        if floor is None:
            return False
        return version < floor[1] if floor[0] is None else (epoch, version) < floor

    def status(self) -> dict[str, Any]:
        """What this receiver serves: ``run``, ``epoch``, ``version`` (None before the first
        activation), ``kind`` and ``activated_at`` of the last activation, ``started_at`` (when
        this subscriber was made: ``activated_at - started_at`` is its time to serving), the
        number of activations and of refusals."""
        last = self.timings[-1] if self.timings else None
        return {
            "run": self.chain.run,
            "epoch": self.live_epoch,
            "version": self.live_version,
            "kind": last.kind if last else None,
            "activated_at": last.activated_at if last else None,
            "started_at": self.started_at,
            "activations": len(self.timings),
            "refused": len(self.refused),
        }

    def audit(self) -> list[str]:
        """Sum the staged state in full (``VersionChain.audit``); damaged tensors are logged
        and counted as a refusal, and the next frame fetched is an anchor."""
        self.last_audit = time.monotonic()
        damaged = self.chain.audit()
        if damaged:
            # the catch-up from the anchor is staged, never activated below what is live
            if self.live_version is not None and self.floor is None:
                self.floor_epoch, self.floor_version = self.live_epoch, self.live_version
            self.refused.append(f"audit: held tensors no longer match their sums: {damaged[:3]}")
            log.error(
                "weight-sync audit: held tensors %s no longer match their sums; asking for an anchor",
                damaged[:3],
            )
            self.source.reset()
        return damaged

    def _refuse(self, exc: WeightSyncError) -> None:
        self.refused.append(f"{type(exc).__name__}: {exc}")
        log.warning("weight-sync frame refused: %s", exc)
        self.source.reset()  # reconnect and ask for what we lack from our (unchanged) version

    def poll(self, timeout: float | None = None) -> SyncTiming | None:
        """Fetch, stage and activate at most one frame. None if nothing arrived in time, the
        frame (or the source's handshake, or its file) was refused (see ``refused``), or it
        was staged below the floor (not activated)."""
        t0 = time.monotonic()
        if self.audit_every_s is not None and t0 - self.last_audit >= self.audit_every_s:
            self.audit()
        # A source that hands records on as they arrive (TCP) is decoded while the rest of
        # the frame is on the wire; a store's frames come whole.
        streamed = self.source.streams
        fetch = self.source.next_records if streamed else self.source.next_frame
        try:
            frame = fetch(self.chain.version, timeout, epoch=self.chain.epoch, floor=self.floor)
        except WeightSyncError as exc:  # a handshake, or a store file, refused before staging
            self._refuse(exc)
            return None
        if frame is None:
            return None
        t1 = time.monotonic()
        self.chain.floor_epoch = self.floor_epoch  # refuses older epochs before staging
        try:
            result = self.chain.apply_records(frame) if streamed else self.chain.apply(frame)
        except FrameInterruptedError as exc:  # cut off on the way: rolled back, ask again
            log.info("frame not complete: %s", exc)
            return None
        except WeightSyncError as exc:
            self._refuse(exc)
            return None
        # streamed: fetch and decode overlap (decode_s runs from the first record to the
        # frame verified; fetch_s from the first record to the last)
        fetch_s = self.source.last_fetch_s or t1 - t0
        decode_s = time.monotonic() - t1
        size = self.source.last_frame_bytes if streamed else len(frame)
        if self._below_floor(result.header.epoch, result.header.version):
            log.info(
                "staged v%d on the way to the floor %s; not activated", result.header.version, self.floor
            )
            return None
        t2 = time.monotonic()
        self.activate(self.chain.state, self.chain.version)
        activate_s = time.monotonic() - t2
        self.live_version, self.live_epoch = self.chain.version, self.chain.epoch
        timing = SyncTiming(
            version=result.header.version,
            kind=result.header.kind,
            bytes=size,
            fetch_s=fetch_s,
            decode_s=decode_s,
            verify_s=result.verify_s,
            activate_s=activate_s,
            activated_at=time.time(),
            epoch=result.header.epoch,
        )
        self.timings.append(timing)
        return timing

    def reached(self, version: int, epoch: int | None = None) -> bool:
        """Whether ``version`` (of ``epoch``, when given) or a later one of that epoch is live."""
        if self.live_version is None or (epoch is not None and self.live_epoch != epoch):
            return False
        return self.live_version >= version

    def run_until(self, version: int, timeout: float, epoch: int | None = None) -> bool:
        """Poll until ``version`` (of ``epoch``, when given) is live or ``timeout`` passes;
        True if it got there."""
        deadline = time.monotonic() + timeout
        while not self.reached(version, epoch):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.poll(remaining)
        return True

    def stage_until(
        self, target: int, timeout_s: float, max_refusals: int, epoch: int | None = None
    ) -> list[SyncTiming]:
        """Poll until ``target`` (or a newer version; of ``epoch`` when given) is staged;
        return this call's timings. A receiver that already holds a newer epoch than
        ``epoch`` fails at once: the publisher it was sent to was replaced.

        Raises ``VersionNotReachedError`` after ``timeout_s`` or after more than
        ``max_refusals`` refused frames (each refusal reconnects and asks again, which heals
        corruption on the wire); the staged state then stays at the version held before."""
        deadline = time.monotonic() + timeout_s
        refused_before, first = len(self.refused), len(self.timings)
        while not self.reached(target, epoch):
            if epoch is not None and self.live_epoch is not None and self.live_epoch > epoch:
                raise VersionNotReachedError(
                    f"this receiver holds epoch {self.live_epoch:x}, newer than the publisher's "
                    f"{epoch:x}: that publisher was replaced by a newer trainer of the run"
                )
            refusals = len(self.refused) - refused_before
            if refusals > max_refusals:
                raise VersionNotReachedError(
                    f"version {target} refused {refusals} times; weights stay at version "
                    f"{self.live_version}; last: {self.refused[-1]}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise VersionNotReachedError(
                    f"version {target} did not arrive within {timeout_s}s; weights stay at "
                    f"version {self.live_version}"
                )
            self.poll(remaining)
        return self.timings[first:]


def tcp_subscriber(
    current: Subscriber | None,
    addr: tuple[str, int],
    target: int,
    config: CodecConfig,
    *,
    key=FROM_ENV,
    tls: bool = False,
    epoch: int | None = None,
) -> Subscriber:
    """The subscriber that should stage ``target`` (of ``epoch``, when the caller knows it)
    from the frame server at ``addr`` (``key``, ``tls``: see ``TcpSource``).

    ``current`` is always kept, whatever server the pull names: its chain takes a newer epoch's
    anchor by itself and refuses an older epoch (``VersionChain``), its staged state is the next
    delta's base, and its floor stays; only its connection moves when the server did (the old
    one is closed). A fresh chain would load whatever the named server holds — a replaced
    trainer that still runs could move the receiver back to its stale weights. ``target`` and
    ``epoch`` are checked against what is held by the caller (``vllm_extension.check_pull_floor``)."""
    from modal_rl.weightsync.transport.tcp import TcpSource

    if current is None:
        return Subscriber(TcpSource(*addr, key=key, tls=tls), lambda _state, _version: None, config=config)
    if not isinstance(current.source, TcpSource) or (current.source.addr, current.source.tls) != (addr, tls):
        current.source.close()
        current.source = TcpSource(*addr, key=key, tls=tls)
    return current


def copy_into(live: dict[str, Any]) -> Activate:
    """An activation callback that copies the staged tensors into ``live`` in place, as an
    engine's weight loader would (creating them on the first call)."""

    def activate(staged: dict[str, Any], version: int) -> None:
        for name, tensor in staged.items():
            held = live.get(name)
            if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
                if held.device.type == "cpu":
                    np.copyto(words_of(held), words_of(tensor))  # memcpy, no OpenMP pool
                else:
                    held.copy_(tensor)
            else:
                live[name] = tensor.clone()

    return activate
