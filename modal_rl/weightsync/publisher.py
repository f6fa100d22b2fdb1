"""Publisher: the trainer's side of weight sync.

Invariants:
- ``snapshot`` holds, bit for bit, the last version published (on the host; in pinned
  memory when the trainer's tensors are on CUDA, so device→host copies are fast);
- every frame names the run (``run``) and this publisher's ``epoch`` (drawn when it is made:
  one trainer start = one epoch; a store may raise it to stay above the previous holder's,
  see ``epoch``); a sink that keeps a lease (stores) grants it when the publisher is made,
  and refuses a second publisher while the lease is live (``LeaseHeldError``);
- versions strictly increase within the epoch; the first version may be any number (a
  trainer restarted from a checkpoint resumes its numbering there: ``start_version`` or the
  first ``publish(version=...)``), and the first frame of an epoch is always an anchor;
- on the wire, the first version and every ``anchor_every``-th after it are anchors
  (``None``: only the first, and after a failure), the rest deltas against the previous
  version;
- every ``recovery_every``-th version without an anchor gets a *recovery anchor* as well:
  an anchor of the same version handed to the sink's ``send_recovery`` (kept for cold and
  restarted receivers, not streamed to the live ones), so catching up costs at most one
  anchor plus ``recovery_every`` deltas while live receivers only ever get deltas;
- a version whose encode or send fails leaves the snapshot at the previous version, and
  the next publish is an anchor (receivers may have seen a partial frame and refused it).

Records go to the transport as the encoder produces them, so a group is on the wire while
later ones are still being encoded.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from modal_rl.weightsync.codec.dtypes import words_of
from modal_rl.weightsync.codec.encode import CodecConfig, Tensors, encode_anchor, encode_delta
from modal_rl.weightsync.transport.base import FrameSink
from modal_rl.weightsync.wire.auth import run_id_of
from modal_rl.weightsync.wire.epoch import new_epoch
from modal_rl.weightsync.wire.frames import VersionHeader, stamp

log = logging.getLogger(__name__)


@dataclass
class PublishReport:
    version: int
    kind: str
    bytes: int
    raw_bytes: int
    seconds: float
    epoch: int = 0
    recovery_bytes: int = 0  # a recovery anchor written with this version (0: none)


class Publisher:
    def __init__(
        self,
        sink: FrameSink,
        *,
        anchor_every: int | None = 16,
        recovery_every: int | None = None,
        config: CodecConfig | None = None,
        run: str | None = None,
        epoch: int | None = None,
        start_version: int = 0,
    ) -> None:
        for name, value in (("anchor_every", anchor_every), ("recovery_every", recovery_every)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {value}")
        self.sink = sink
        self.anchor_every = anchor_every
        self.recovery_every = recovery_every
        self.config = config or CodecConfig()
        self.run = run or run_id_of(sink.keys)
        self.epoch = epoch if epoch is not None else new_epoch()
        # a store takes its lease here: a second trainer fails now
        self.epoch = sink.open_epoch(self.run, self.epoch)
        self.start_version = start_version
        self.snapshot: dict[str, Any] = {}
        self.checksums: dict[str, str] = {}
        self.version: int | None = None
        self._since_anchor = 0
        self._since_recovery = 0
        self._force_anchor = True
        # the previous snapshot's buffers, reused for the next version's copy: a version then
        # costs no allocation (nor page faults), and the publisher's peak stays at two copies
        self._spare: dict[str, Any] = {}
        self._prefault: _Prefault | None = None
        from modal_rl.weightsync.codec.warmup import start_warm_up

        start_warm_up(self.config.threads)  # the encoder's kernels load before the first delta

    def _to_host(self, name: str, tensor: Any) -> Any:
        """Copy into a host buffer owned by the publisher (the caller may reuse its tensor)."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            tensor = torch.as_tensor(tensor)
        pin = tensor.device.type == "cuda"
        out = self._prefault.take(name) if self._prefault is not None else None
        if out is None:
            out = self._spare.pop(name, None)
        if out is None or out.shape != tensor.shape or out.dtype != tensor.dtype or out.is_pinned() != pin:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        if pin:
            out.copy_(tensor.detach(), non_blocking=True)
            torch.cuda.current_stream(tensor.device).synchronize()
        else:
            # A plain memcpy: torch's CPU copy fans out to its OpenMP pool, whose spinning
            # threads measured 5x slower publishes on a busy 2-core host.
            np.copyto(words_of(out), words_of(tensor.detach()))
        return out

    def _config_for_link(self) -> CodecConfig:
        """The codec config for this publish: a sink that knows each receiver's share of
        its link (a rate-limited frame server) lets deltas be coded for time on that link,
        unless the config already names a link; with it, the decode costs its receivers
        measured and named in their hellos (``decode_costs``)."""
        share = self.sink.link_share_bytes_per_s
        if self.config.link_bytes_per_s is not None or share is None:
            return self.config
        costs = self.config.receiver_costs or self.sink.receiver_costs
        return dataclasses.replace(self.config, link_bytes_per_s=share, receiver_costs=costs)

    @property
    def next_version(self) -> int:
        """The version ``publish`` uses when it is given none."""
        return self.start_version if self.version is None else self.version + 1

    def publish(self, tensors: Tensors, version: int | None = None) -> PublishReport:
        """Publish one version: a state dict, or an iterator of ``(name, tensor)`` pairs."""
        if version is None:
            version = self.next_version
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} is not newer than the last published {self.version}")
        every = self.anchor_every
        anchor = self._force_anchor or (every is not None and self._since_anchor + 1 >= every)
        staged: dict[str, Any] = {}

        def host_items() -> Iterator[tuple[str, Any]]:
            items = tensors.items() if isinstance(tensors, Mapping) else tensors
            for name, tensor in items:
                staged[name] = self._to_host(name, tensor)
                yield name, staged[name]

        sums: dict[str, str] = {}
        t0 = time.perf_counter()
        config = self._config_for_link()
        if anchor:
            records = encode_anchor(host_items(), version=version, config=config, checksums_out=sums)
            header = VersionHeader("anchor", version, None, run=self.run, epoch=self.epoch)
        else:
            records = encode_delta(
                self.snapshot,
                host_items(),
                base_version=self.version,
                version=version,
                config=config,
                base_checksums=self.checksums,
                checksums_out=sums,
            )
            header = VersionHeader("delta", version, self.version, run=self.run, epoch=self.epoch)
        try:
            size = self.sink.send(header, stamp(records, self.run, self.epoch))
        except BaseException:
            self._force_anchor = True
            raise
        self._spare = self.snapshot
        self.snapshot, self.checksums, self.version = staged, sums, version
        self._prefault = _Prefault(self.snapshot) if not self._spare else None
        self._force_anchor = False
        self._since_anchor = 0 if anchor else self._since_anchor + 1
        self._since_recovery = 0 if anchor else self._since_recovery + 1
        recovery = 0
        if self.recovery_every is not None and self._since_recovery >= self.recovery_every:
            recovery = self._send_recovery(version)
        raw = sum(t.numel() * t.element_size() for t in staged.values())
        return PublishReport(version, header.kind, size, raw, time.perf_counter() - t0, self.epoch, recovery)

    def _send_recovery(self, version: int) -> int:
        """An anchor of the version just published, for receivers that catch up. Its failure
        costs only catch-up length (the next version tries again), so it is logged, not raised
        — except a lost lease, which ends this publisher."""
        if not self.sink.recovery_anchors:
            return 0
        from modal_rl.weightsync.errors import LeaseLostError

        header = VersionHeader("anchor", version, None, run=self.run, epoch=self.epoch)
        records = encode_anchor(self.snapshot.items(), version=version, config=self.config)
        try:
            size = self.sink.send_recovery(header, stamp(records, self.run, self.epoch))
        except LeaseLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("recovery anchor for v%d not written: %s", version, exc)
            return 0
        self._since_recovery = 0
        return size


class _Prefault:
    """The second host copy (the next version's buffers), made on a background thread with
    its pages touched. Only the first publish has no spare buffers; without this the first
    delta paid a whole state's page faults (2 GB bf16, published alone: 2.2 s against 1.1 s
    for the next deltas). Nothing ever waits for it: the next publish ``take``s each buffer
    that is ready and allocates the others itself, which the thread then skips (on a busy
    host, waiting for it cost the first delta 2.7 s at 2 GB). The peak stays at the two
    copies a publisher holds anyway."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._ready: dict[str, Any] = {}
        self._claimed: set[str] = set()
        self.thread = threading.Thread(target=self._make, args=(dict(snapshot),), name="publisher-prefault")
        self.thread.daemon = True
        self.thread.start()

    def take(self, name: str) -> Any | None:
        """The buffer made for ``name``, or None (not made yet: it will not be)."""
        with self._lock:
            self._claimed.add(name)
            return self._ready.pop(name, None)

    def _make(self, snapshot: dict[str, Any]) -> None:
        import torch

        try:
            for name, held in snapshot.items():
                with self._lock:
                    if name in self._claimed:
                        continue
                out = torch.empty(held.shape, dtype=held.dtype, pin_memory=held.is_pinned())
                words = words_of(out)
                words[:: max(1, 4096 // words.itemsize)] = 0  # one store per page faults it in
                with self._lock:
                    if name not in self._claimed:
                        self._ready[name] = out
        except Exception as exc:  # the next copy allocates what is missing, as without it
            log.warning("weight sync: could not prepare the next version's buffers: %s", exc)
