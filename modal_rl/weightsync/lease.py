"""One trainer at a time on a store: the publisher's lease.

A store's ``lease`` file is a JSON record ``{run, holder, epoch, renewed_at, expires_at, ttl_s,
mac}``: ``holder`` names the publisher (host, pid and a random tag), ``epoch`` the trainer
start it publishes, ``mac`` an HMAC-SHA256 of the rest under a key derived from the run key
(``auth.sign_json``). It is written like every store file (temporary name, fsync, rename; on a
Modal Volume, then ``commit()``), so a reader sees either the old record or the new one.

Invariants:
- a publisher is made only while no other holder's lease is live (``LeaseHeldError`` after
  ``wait_s``, naming the holder, its expiry and the fix); a lease is live until
  ``expires_at``, or until its holder's process is gone when the holder ran on this host (a
  SIGKILLed trainer restarted on the same machine takes over at once);
- a new holder's epoch is greater than the previous holder's (``epoch.new_epoch(after=...)``),
  so store epochs increase whatever the hosts' clocks say;
- the holder renews the lease (a heartbeat thread every ``ttl_s / 4``, and before every
  frame and pointer write); a renewal that finds another holder's record raises
  ``LeaseLostError`` then and at every later publish: a trainer whose lease lapsed and was
  taken stops publishing. A lapsed lease nobody took is simply renewed;
- a record whose MAC does not match (written without the run's key) does not count: it is
  logged and overwritten.

Two publishers that write the record in the same instant both pass their first read; each
reads the record back after writing it and only the one that finds its own name proceeds.
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

from modal_rl.weightsync.auth import FrameKeys, sign_json, verify_json
from modal_rl.weightsync.epoch import describe, new_epoch
from modal_rl.weightsync.errors import LeaseHeldError, LeaseLostError

log = logging.getLogger(__name__)
LEASE_FILE = "lease"


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
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            log.warning("lease record %s is not JSON; ignoring it", self.path)
            return None
        if not isinstance(raw, dict) or not verify_json(self.keys, raw):
            log.warning("lease record %s is not signed with this run's key; ignoring it", self.path)
            return None
        try:
            return LeaseRecord(**{k: v for k, v in raw.items() if k != "mac"})
        except TypeError:
            log.warning("lease record %s is malformed; ignoring it", self.path)
            return None

    def _put(self, record: LeaseRecord) -> None:
        self._write(self.path, json.dumps(sign_json(self.keys, asdict(record))).encode())

    def acquire(self, run: str, epoch: int, *, wait_s: float = 0.0, after_epoch: int | None = None) -> int:
        """Take the lease for ``run``; returns the epoch to publish (``epoch``, raised above the
        previous holder's and ``after_epoch``). Waits up to ``wait_s`` for a live lease to lapse."""
        deadline = time.monotonic() + wait_s
        while True:
            self._refresh()
            held, now = self.read(), time.time()
            if held is None or held.holder == self.holder or not held.live(now):
                break
            if time.monotonic() >= deadline:
                raise LeaseHeldError(
                    f"{self.path} is leased to {held.describe(now)}: another trainer of run {held.run} is "
                    "publishing here. Stop it (or wait for its lease to lapse) before starting this one, "
                    "or publish to another store"
                )
            time.sleep(min(0.5, max(0.05, deadline - time.monotonic())))
        floor = max(e for e in (epoch - 1, after_epoch, held.epoch if held else None) if e is not None)
        if epoch <= floor:
            epoch = new_epoch(after=floor)
        record = LeaseRecord(run, self.holder, epoch, now, now + self.ttl_s, self.ttl_s)
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

    def renew(self, write: bool = True) -> None:
        """Extend the lease (``write=False``: only check it is still ours), or raise
        ``LeaseLostError`` if another holder took it."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if self.mine is None:
                raise LeaseLostError(f"{self.path}: this publisher holds no lease (released or never taken)")
            self._refresh()
            held, now = self.read(), time.time()
            if held is not None and held.holder != self.holder:
                self.lost = LeaseLostError(
                    f"this trainer's lease on {self.path} lapsed and {held.describe(now)} took it: a newer "
                    "trainer of the run is publishing, so this one stops (it must not publish again)"
                )
                self._stop.set()
                raise self.lost
            if not write:
                return
            self.mine = LeaseRecord(
                self.mine.run, self.holder, self.mine.epoch, now, now + self.ttl_s, self.ttl_s
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
                self._put(LeaseRecord(self.mine.run, self.holder, self.mine.epoch, now, now, self.ttl_s))
            self.mine = None
