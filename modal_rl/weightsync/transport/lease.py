"""A store's signed records: the publisher's lease (one trainer at a time) and ``latest``.

A store's ``lease`` file is a JSON record ``{run, holder, epoch, renewed_at, expires_at, ttl_s,
after, sig}``: ``holder`` names the publisher (host, pid and a random tag), ``epoch`` the trainer
start it publishes, ``sig`` the trainer's Ed25519 signature of the rest (``auth.sign_json``;
readers hold only the public key, so no receiver can write a lease). It is written like every store file (temporary name, fsync, rename; on a
Modal Volume, then ``commit()``), so a reader sees either the old record or the new one.

Invariants:
- a publisher is made only while no other holder's lease is live (``LeaseHeldError`` after
  ``wait_s``, naming the holder, its expiry and the fix); a lease is live until
  ``expires_at``, or until its holder's process is gone when the holder ran on this host (a
  SIGKILLed trainer restarted on the same machine takes over at once);
- a new holder's epoch is greater than the previous holder's (``epoch.new_epoch(after=...)``),
  so store epochs increase whatever the hosts' clocks say;
- the holder renews the lease (a heartbeat thread every ``ttl_s / 4``, and before every
  frame and pointer write); a renewal that finds another holder's record **of a newer (or
  the same) epoch** raises ``LeaseLostError`` then and at every later publish: a trainer
  whose lease lapsed and was taken stops publishing. A lapsed lease nobody took is simply
  renewed;
- a successor's record names the epoch it took over from (``after``: the newest epoch in the
  store's signed records when it took the lease, so ours or a later one); a record of a newer
  epoch that names an older one (or none) was written by a trainer that never saw ours — the
  loser of a simultaneous start, replayed — and is logged and overwritten like a replay;
- a record of an older epoch than the holder's cannot be a successor's (every successor's
  epoch is above its predecessor's): it is a replayed copy of an old record (no key is
  needed to copy a file back) or a predecessor's late write. It is logged and overwritten
  with the holder's own, and never stops the holder. So is a copy of the holder's own
  earlier record, and one that is missing or unreadable;
- a record whose signature does not match (written without the run's key), a symbolic link,
  a non-regular file or one over ``MAX_LEASE_BYTES`` does not count: it is logged and
  overwritten; so does one claiming an epoch not yet started, a ttl over ``MAX_TTL_S`` or an
  expiry beyond now + ttl (+ ``MAX_CLOCK_SKEW_S``): such a record would hold the store for
  as long as it claims;
- a store whose signed ``latest`` was written less than a ttl ago by a newer epoch than the
  lease record's is held (by that epoch's publisher, whose record was replaced by a replay or
  removed): a second trainer is refused (``LeaseHeldError``) even then.

Two publishers that write the record in the same instant both pass their first read; each
reads the record back after writing it and only the one that finds its own name proceeds.

The ``latest`` pointer (``signed_pointer``, ``read_pointer``) is ``{run, epoch, version, kind,
anchor, at, sig}``: the newest published version, the newest anchor's version in its epoch,
and when it was written (``time.time()``), with ``sig`` the trainer's signature for the
purpose ``"pointer"`` — so a lease record cannot pass for a pointer. An epoch or an ``at``
beyond the reader's clock plus ``MAX_CLOCK_SKEW_S`` is refused. A reader accepts only a pointer signed with its key (keyless: only an unsigned
one); an unsigned pointer is a store written before pointers were signed, refused by name
until the trainer's next publish rewrites it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from modal_rl import wire_json
from modal_rl.retry import wait_for
from modal_rl.weightsync.errors import (
    CorruptFrameError,
    LeaseHeldError,
    LeaseLostError,
    RecordMacError,
    SignedFrameError,
    StoreFileError,
    UnsignedFrameError,
    WeightSyncError,
)
from modal_rl.weightsync.transport.volumes import read_regular
from modal_rl.weightsync.wire.auth import FrameKeys, sign_json, verify_json
from modal_rl.weightsync.wire.epoch import MAX_CLOCK_SKEW_S, MAX_EPOCH, describe, from_the_future, new_epoch

log = logging.getLogger(__name__)
LEASE_FILE = "lease"
POINTER_FILE = "latest"
MAX_LEASE_BYTES = MAX_POINTER_BYTES = 64 << 10  # each is a few hundred bytes of JSON


def new_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class LeaseRecord:
    run: str
    holder: str
    epoch: int
    renewed_at: float
    expires_at: float
    ttl_s: float
    # The newest epoch its holder found in the store's signed records when it took the lease
    # (None: none). A successor of ours names our epoch (or a later one); a record that names
    # an older one was written by a trainer that never saw ours (the loser of a simultaneous
    # start, replayed) and does not stop us.
    after: int | None = None

    def live(self, now: float) -> bool:
        if now >= self.expires_at:
            return False
        host, _, rest = self.holder.partition(":")
        pid = rest.partition(":")[0]
        if host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid():
            import psutil

            return psutil.pid_exists(int(pid))  # on this host: a dead holder holds nothing
        return True

    def describe(self, now: float) -> str:
        return (
            f"publisher {self.holder} (epoch {describe(self.epoch)}) until "
            f"{time.strftime('%H:%M:%S', time.gmtime(self.expires_at))} UTC ({self.expires_at - now:.0f}s from now)"
        )


def _well_typed(r: LeaseRecord) -> bool:
    numbers = (r.renewed_at, r.expires_at, r.ttl_s)
    return (
        isinstance(r.run, str)
        and isinstance(r.holder, str)
        and isinstance(r.epoch, int)
        and not isinstance(r.epoch, bool)
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in numbers)
        and (r.after is None or (isinstance(r.after, int) and not isinstance(r.after, bool)))
    )


MAX_TTL_S = 3600.0  # a lease renews every ttl/4: an hour is far beyond any heartbeat


def _bounded(r: LeaseRecord, now: float) -> bool:
    """Claims a lease may make: an epoch already started, a ttl within ``MAX_TTL_S``, and times
    within that ttl (plus the clock skew) of now, so no record holds a store for years."""
    ahead = now + MAX_CLOCK_SKEW_S
    return (
        0 < r.epoch <= MAX_EPOCH
        and not from_the_future(r.epoch, now)
        and 0 < r.ttl_s <= MAX_TTL_S
        and r.renewed_at <= ahead
        and r.expires_at <= ahead + r.ttl_s
    )


class StoreLease:
    """The lease of one store. ``write(path, data)`` writes atomically and durably;
    ``refresh()`` makes other writers' records visible (a Modal Volume's ``reload``)."""

    def __init__(
        self,
        root: Path,
        keys: FrameKeys | None,
        write: Callable[[Path, bytes], None],
        refresh: Callable[[], None],
        *,
        ttl_s: float = 30.0,
        heartbeat: bool = True,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self.path = Path(root) / LEASE_FILE
        self.keys = keys
        self._write, self._refresh = write, refresh
        self.ttl_s = ttl_s
        self.heartbeat = heartbeat
        self.holder = new_holder()
        self.mine: LeaseRecord | None = None
        self.lost: LeaseLostError | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def read(self) -> LeaseRecord | None:
        try:
            raw = wire_json.loads(
                read_regular(self.path, MAX_LEASE_BYTES), max_bytes=MAX_LEASE_BYTES, max_depth=4
            )
        except FileNotFoundError:
            return None
        except StoreFileError as exc:
            log.warning("lease record ignored: %s", exc)
            return None
        except ValueError:
            log.warning("lease record %s is not JSON; ignoring it", self.path)
            return None
        if not isinstance(raw, dict) or not verify_json(self.keys, raw):
            log.warning("lease record %s is not signed with this run's key; ignoring it", self.path)
            return None
        try:
            record = LeaseRecord(**{k: v for k, v in raw.items() if k != "sig"})
        except TypeError:
            record = None
        if record is None or not _well_typed(record):  # keyless records are anyone's to write
            log.warning("lease record %s is malformed; ignoring it", self.path)
            return None
        if not _bounded(record, time.time()):
            log.warning(
                "lease record %s claims a start or an expiry beyond this clock's reach (epoch %s, "
                "expires %.0fs from now); ignoring it",
                self.path,
                describe(record.epoch),
                record.expires_at - time.time(),
            )
            return None
        return record

    def _put(self, record: LeaseRecord) -> None:
        self._write(self.path, json.dumps(sign_json(self.keys, asdict(record))).encode())

    def acquire(self, run: str, epoch: int, *, wait_s: float = 0.0, after_epoch: int | None = None) -> int:
        """Take the lease for ``run``; returns the epoch to publish (``epoch``, raised above the
        previous holder's and ``after_epoch``). Waits up to ``wait_s`` for a live lease to lapse."""
        last: dict = {}  # the last look, which the refusal names

        def lapsed() -> bool:
            self._refresh()
            held, now = self.read(), time.time()
            free = held is None or held.holder == self.holder or not held.live(now)
            busy = self._newer_publisher(held, now) if free else None
            last.update(held=held, now=now, busy=busy)
            return free and busy is None

        free = wait_for(lapsed, wait_s, poll_s=0.5)
        held, now = last["held"], last["now"]  # the record and time the lease is taken at
        if not free:
            who = last["busy"] or f"{self.path} is leased to {held.describe(now)}"
            raise LeaseHeldError(
                f"{who}: another trainer of run {(held.run if held else None) or run} is publishing "
                "here. Stop it (or wait for its lease to lapse) before starting this one, or publish "
                "to another store"
            )
        seen = [e for e in (after_epoch, held.epoch if held else None) if e is not None]
        took_over = max(seen) if seen else None  # what this lease follows (signed records only)
        floor = max(e for e in (epoch - 1, took_over) if e is not None)
        if epoch <= floor:
            epoch = new_epoch(after=floor)
        record = LeaseRecord(run, self.holder, epoch, now, now + self.ttl_s, self.ttl_s, took_over)
        self._put(record)
        self._refresh()
        back = self.read()
        if back is None or back.holder != self.holder:  # lost a simultaneous race
            raise LeaseHeldError(
                f"{self.path} was taken at the same moment by {back.holder if back else 'another publisher'}; "
                "another trainer of this run is starting: stop one of them"
            )
        self.mine = record
        if self.heartbeat and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="weightsync-lease", daemon=True)
            self._thread.start()
        return epoch

    def _newer_publisher(self, held: LeaseRecord | None, now: float) -> str | None:
        """Why the store is busy although its lease record is not live: ``latest`` (signed)
        was written within a ttl by a newer epoch than the record's — its publisher is alive
        and the record is a replayed old one (or was removed); its heartbeat restores it."""
        try:
            pointer = read_pointer(self.path.with_name(POINTER_FILE), self.keys)
        except (WeightSyncError, OSError):
            return None
        epoch, at = pointer.get("epoch"), pointer.get("at")
        ttl = max(self.ttl_s, held.ttl_s if held else 0.0)
        if not isinstance(at, int | float) or epoch <= (held.epoch if held else -1) or now - at >= ttl:
            return None
        if at > now + MAX_CLOCK_SKEW_S:  # read_pointer refuses these; kept here for the message
            return None
        return (
            f"{self.path.with_name(POINTER_FILE)} was signed {now - at:.0f}s ago by epoch {describe(epoch)}, "
            f"newer than the lease record's ({held.holder if held else 'none'}: replayed or removed)"
        )

    def renew(self, write: bool = True) -> None:
        """Extend the lease (``write=False``: only check it is still ours, rewriting it only
        when the store holds something else), or raise ``LeaseLostError`` if another holder
        took it (a record of a newer epoch; see the module invariants)."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if self.mine is None:
                raise LeaseLostError(f"{self.path}: this publisher holds no lease (released or never taken)")
            self._refresh()
            held, now = self.read(), time.time()
            successor = held is not None and held.after is not None and held.after >= self.mine.epoch
            if (
                held is not None
                and held.holder != self.holder
                and held.epoch >= self.mine.epoch
                and successor
            ):
                # Only a later acquire writes a newer epoch: taken, whatever its expiry (a
                # successor that lapsed in turn may have had receivers move to its epoch).
                self.lost = LeaseLostError(
                    f"this trainer's lease on {self.path} lapsed and {held.describe(now)} took it: a newer "
                    "trainer of the run is publishing, so this one stops (it must not publish again)"
                )
                self._stop.set()
                raise self.lost
            if held is not None and held.holder != self.holder:
                log.warning(
                    "lease record of %s (epoch %s, after %s) is no successor of this publisher's epoch %s: "
                    "a replayed, late or simultaneous-start loser's record; it does not count and is overwritten",
                    held.holder,
                    describe(held.epoch),
                    describe(held.after),
                    describe(self.mine.epoch),
                )
            if not write and held == self.mine:
                return  # ours, exactly as last written: nothing to repair
            self.mine = LeaseRecord(
                self.mine.run,
                self.holder,
                self.mine.epoch,
                now,
                now + self.ttl_s,
                self.ttl_s,
                self.mine.after,
            )
            self._put(self.mine)

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLostError as exc:
                log.error("%s", exc)
                return
            except OSError as exc:  # a flaky volume: the next beat or publish tries again
                log.warning("lease heartbeat failed: %s", exc)

    def release(self) -> None:
        """Give the lease up (end of a run): the next trainer need not wait for it to lapse."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2)
        with self._lock:
            if self.mine is None or self.lost is not None:
                return
            self._refresh()
            held = self.read()
            if held is not None and held.holder == self.holder:
                now = time.time()
                self._put(
                    LeaseRecord(
                        self.mine.run, self.holder, self.mine.epoch, now, now, self.ttl_s, self.mine.after
                    )
                )
            self.mine = None


def signed_pointer(keys: FrameKeys | None, pointer: dict) -> dict:
    """``pointer`` (run, epoch, version, kind, anchor) stamped with the time and signed."""
    return sign_json(keys, pointer | {"at": time.time()}, "pointer")


def read_pointer(path: Path, keys: FrameKeys | None) -> dict:
    """The ``latest`` pointer at ``path``, verified ({} when there is none), or a one-line
    refusal: a link or oversized file (``StoreFileError``), not JSON or malformed
    (``CorruptFrameError``), unsigned (``UnsignedFrameError``), signed for a keyless reader
    (``SignedFrameError``), or altered / another key's (``RecordMacError``)."""
    try:
        data = wire_json.loads(
            read_regular(path, MAX_POINTER_BYTES), max_bytes=MAX_POINTER_BYTES, max_depth=4
        )
    except FileNotFoundError:
        return {}
    except ValueError:
        raise CorruptFrameError(f"{path} is not a JSON pointer; refused") from None
    if not isinstance(data, dict):
        raise CorruptFrameError(f"{path} is not a JSON object; refused")
    if keys is not None and "sig" not in data:
        raise UnsignedFrameError(
            f"{path} is not signed by the trainer (written by a modal-rl before signed pointers, or by "
            "someone without the run's key); refused: the trainer's next publish to this store signs it"
        )
    if keys is None and ("sig" in data or "mac" in data):
        raise SignedFrameError(f"{path} is signed with a run key, but this reader is keyless (key=None)")
    if not verify_json(keys, data, "pointer"):
        raise RecordMacError(f"{path} fails its signature: altered, or not signed by this run's trainer")
    numbers = [data.get(k) for k in ("epoch", "version")]
    if data.get("kind") not in ("anchor", "delta") or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_EPOCH for x in numbers
    ):
        raise CorruptFrameError(f"{path} does not name an epoch, a version and a kind; refused")
    at, now = data.get("at"), time.time()
    if from_the_future(data["epoch"], now) or (
        isinstance(at, int | float) and not isinstance(at, bool) and at > now + MAX_CLOCK_SKEW_S
    ):
        raise CorruptFrameError(
            f"{path} claims an epoch or a time beyond this clock plus {MAX_CLOCK_SKEW_S:.0f}s; refused"
        )
    return data
