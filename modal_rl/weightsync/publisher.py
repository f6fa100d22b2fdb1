"""Publisher: the trainer's side of weight sync.

Invariants:
- ``snapshot`` holds, bit for bit, the last version published. It is the publisher's one
  copy of the state: an anchor copies into its buffers, a delta diffs the trainer's tensors
  against it and writes only the changed words into it (``encode_delta(update_base=True)``),
  so a version costs no second copy and no whole-state memcpy. Where it lives is
  ``snapshot_on``:
  ``"host"`` (default): host memory, diffed by the compiled CPU kernels; a CUDA tensor is
  copied to a pinned host buffer first (a device→host copy of the state per version);
  ``"device"``: beside the trainer's tensors (a GPU's memory for CUDA tensors), diffed there
  by torch (``TorchDiffer``): only changed positions and words cross to the host. It costs a
  copy of the shard in device memory instead of host memory;
- ``checksums`` are the snapshot's ls128 sums, moved by every delta's changed words. An
  *audit* (``audit()``, run off the publish path every ``audit_every_s`` on a thread of its
  own, between publishes) sums the snapshot in full: a word damaged where no delta writes
  would make every receiver refuse every delta until the next anchor, so a mismatch makes
  the next publish an anchor, which rewrites the whole snapshot from the trainer's tensors;
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
- a version whose encode or send fails leaves the snapshot mixed (some chunks updated),
  and the next publish is an anchor, which rewrites all of it (receivers may have seen a
  partial frame and refused it; the version number stays the last one sent whole).

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

from modal_rl.weightsync.codec.differ import Differ, TorchDiffer
from modal_rl.weightsync.codec.dtypes import words_of
from modal_rl.weightsync.codec.encode import CodecConfig, Tensors, encode_anchor, encode_delta
from modal_rl.weightsync.transport.base import FrameSink
from modal_rl.weightsync.wire.auth import run_id_of
from modal_rl.weightsync.wire.epoch import new_epoch
from modal_rl.weightsync.wire.frames import VersionHeader, stamp

log = logging.getLogger(__name__)

SNAPSHOT_PLACES = ("host", "device")


@dataclass
class PublishReport:
    version: int
    kind: str
    bytes: int
    raw_bytes: int
    seconds: float
    epoch: int = 0
    recovery_bytes: int = 0  # a recovery anchor written with this version (0: none)


@dataclass(frozen=True)
class PublisherSettings:
    """When a ``Publisher`` sends anchors and audits, and where its snapshot lives.
    ``anchor_every``: a full version every N (``None``: only the first and when forced);
    ``recovery_every``: a recovery anchor every N; ``start_version``: the first version's
    number; ``snapshot_on``: ``"host"`` or ``"device"`` (see the module docstring);
    ``audit_every_s``: seconds between whole-snapshot audits (``None``: never)."""

    anchor_every: int | None = 16
    recovery_every: int | None = None
    start_version: int = 0
    snapshot_on: str = "host"
    audit_every_s: float | None = 600.0

    def __post_init__(self) -> None:
        for name, value in (("anchor_every", self.anchor_every), ("recovery_every", self.recovery_every)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {value!r}")
        if self.snapshot_on not in SNAPSHOT_PLACES:
            raise ValueError(f"snapshot_on must be one of {SNAPSHOT_PLACES}, got {self.snapshot_on!r}")
        if self.audit_every_s is not None and self.audit_every_s <= 0:
            raise ValueError(f"audit_every_s must be > 0 (or None: never), got {self.audit_every_s}")

    def with_overrides(self, **overrides: Any) -> PublisherSettings:
        """These settings with ``overrides`` applied; an unknown name is one line listing the known."""
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise TypeError(
                f"unknown Publisher setting(s) {', '.join(unknown)}; the settings are: {', '.join(known)}"
            )
        return dataclasses.replace(self, **overrides) if overrides else self


class Publisher:
    def __init__(
        self,
        sink: FrameSink,
        *,
        config: CodecConfig | None = None,
        run: str | None = None,
        epoch: int | None = None,
        settings: PublisherSettings | None = None,
        **overrides: Any,
    ) -> None:
        settings = (settings or PublisherSettings()).with_overrides(**overrides)
        anchor_every, recovery_every = settings.anchor_every, settings.recovery_every
        start_version, snapshot_on = settings.start_version, settings.snapshot_on
        audit_every_s = settings.audit_every_s
        self.settings = settings
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
        # the snapshot's host word views (``words_of``), made once per anchor for the deltas
        self._snapshot_words: dict[str, Any] | None = None
        # its delta layout (``buckets``), made on the first delta after an anchor; False: none fits
        self._layout: Any = None
        self.checksums: dict[str, str] = {}
        self.version: int | None = None
        self._since_anchor = 0
        self._since_recovery = 0
        self._force_anchor = True
        self.snapshot_on = snapshot_on
        # torch on the tensors' device for a device snapshot; else the codec picks per tensor
        self._differ: Differ | None = TorchDiffer() if snapshot_on == "device" else None
        # host staging for device tensors under a host snapshot (CPU tensors need none)
        self._device_staging: dict[str, Any] = {}
        self.audit_every_s = audit_every_s
        self.last_audit = time.monotonic()
        self.audit_damaged: list[str] = []  # what the last audit found (empty: all matched)
        self._lock = threading.Lock()  # a publish and an audit never overlap
        self._audit_thread: threading.Thread | None = None
        from modal_rl.weightsync.codec.warmup import start_warm_up

        start_warm_up(self.config.threads)  # the encoder's kernels load before the first delta

    def _keep(self, name: str, tensor: Any, buffers: dict[str, Any], on_host: bool) -> Any:
        """Copy into a buffer owned by the publisher (the caller may reuse its tensor):
        ``buffers[name]`` when it fits, else a new one, on the host (pinned for a CUDA tensor)
        or, with ``on_host=False``, beside the tensor."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            tensor = torch.as_tensor(tensor)
        device = torch.device("cpu") if on_host else tensor.device
        pin = on_host and tensor.device.type == "cuda"
        out = buffers.get(name)
        if (
            out is None
            or out.shape != tensor.shape
            or out.dtype != tensor.dtype
            or out.device != device
            or (device.type == "cpu" and out.is_pinned() != pin)
        ):
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
        if pin:
            out.copy_(tensor.detach(), non_blocking=True)
            torch.cuda.current_stream(tensor.device).synchronize()
        elif device.type == "cpu":
            # A plain memcpy: torch's CPU copy fans out to its OpenMP pool, whose spinning
            # threads measured 5x slower publishes on a busy 2-core host.
            np.copyto(words_of(out), words_of(tensor.detach()))
        else:
            out.copy_(tensor.detach())
        return out

    def _delta_input(self, name: str, tensor: Any) -> Any:
        """What a delta diffs against the snapshot: a tensor as it lies (read only) where the
        snapshot is beside it, a device tensor's copy in host staging under a host snapshot."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            # an array: read as it lies (as a tensor for torch's diff)
            return torch.from_numpy(np.asarray(tensor)) if self._differ is not None else tensor
        if tensor.device.type != "cpu" and self.snapshot_on == "host":
            self._device_staging[name] = self._keep(name, tensor, self._device_staging, on_host=True)
            return self._device_staging[name]
        return tensor.detach()

    def _base_words(self) -> dict[str, Any] | None:
        """The host snapshot's word views, made on the first delta after an anchor (the
        snapshot's buffers stay the same until the next one)."""
        if self.snapshot_on != "host":
            return None
        if self._snapshot_words is None:
            self._snapshot_words = {
                name: words_of(t) for name, t in self.snapshot.items() if t.device.type == "cpu"
            }
        return self._snapshot_words

    def _delta_layout(self) -> Any:
        """The host snapshot's delta layout (``buckets.DeltaLayout``), made on the first delta
        after an anchor; None where the snapshot does not qualify (a device snapshot, no numba)."""
        if self._layout is None:
            from modal_rl.weightsync.codec.buckets import DeltaLayout

            fits = self.snapshot_on == "host" and self._differ is None
            self._layout = (fits and DeltaLayout.build(self.snapshot, self.config.chunk_elems)) or False
        return self._layout or None

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
        """Publish one version: a state dict, or an iterator of ``(name, tensor)`` pairs.
        Waits for an audit still running; starts one after it when one is due."""
        with self._lock:
            report = self._publish(tensors, version)
        self._audit_if_due()
        return report

    def _publish(self, tensors: Tensors, version: int | None) -> PublishReport:
        if version is None:
            version = self.next_version
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} is not newer than the last published {self.version}")
        every = self.anchor_every
        anchor = self._force_anchor or (every is not None and self._since_anchor + 1 >= every)
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        staged: dict[str, Any] = {}

        def anchor_items() -> Iterator[tuple[str, Any]]:
            # into the snapshot's own buffers: the publisher never holds two copies
            for name, tensor in items:
                staged[name] = self._keep(name, tensor, self.snapshot, self.snapshot_on == "host")
                yield name, staged[name]

        def delta_items() -> Iterator[tuple[str, Any]]:
            import torch

            host = torch.Tensor
            for name, tensor in items:
                # a host tensor is read as it lies (the encoder only reads it)
                yield (
                    name,
                    tensor if isinstance(tensor, host) and tensor.is_cpu else self._delta_input(name, tensor),
                )

        sums: dict[str, str] = {}
        t0 = time.perf_counter()
        config = self._config_for_link()
        if anchor:
            records = encode_anchor(
                anchor_items(), version=version, config=config, checksums_out=sums, differ=self._differ
            )
            header = VersionHeader("anchor", version, None, run=self.run, epoch=self.epoch)
        elif (layout := self._delta_layout()) is not None:
            records = layout.encode_delta(
                delta_items(),
                base_version=self.version,
                version=version,
                config=config,
                base_checksums=self.checksums,
                checksums_out=sums,
                update_base=True,
            )
            header = VersionHeader("delta", version, self.version, run=self.run, epoch=self.epoch)
        else:
            records = encode_delta(
                self.snapshot,
                delta_items(),
                base_version=self.version,
                version=version,
                config=config,
                base_checksums=self.checksums,
                checksums_out=sums,
                differ=self._differ,
                update_base=True,
                base_words=self._base_words(),
            )
            header = VersionHeader("delta", version, self.version, run=self.run, epoch=self.epoch)
        try:
            size = self.sink.send(header, stamp(records, self.run, self.epoch))
        except BaseException:
            self._force_anchor = True
            raise
        if anchor:
            self.snapshot, self._snapshot_words, self._layout = staged, None, None
        self.checksums, self.version = sums, version
        self._force_anchor = False
        self._since_anchor = 0 if anchor else self._since_anchor + 1
        self._since_recovery = 0 if anchor else self._since_recovery + 1
        recovery = 0
        if self.recovery_every is not None and self._since_recovery >= self.recovery_every:
            recovery = self._send_recovery(version)
        raw = self._layout.raw_bytes if self._layout else sum(t.nbytes for t in self.snapshot.values())
        return PublishReport(version, header.kind, size, raw, time.perf_counter() - t0, self.epoch, recovery)

    def _send_recovery(self, version: int) -> int:
        """An anchor of the version just published, for receivers that catch up. Its failure
        costs only catch-up length (the next version tries again), so it is logged, not raised
        — except a lost lease, which ends this publisher."""
        if not self.sink.recovery_anchors:
            return 0
        from modal_rl.weightsync.errors import LeaseLostError

        header = VersionHeader("anchor", version, None, run=self.run, epoch=self.epoch)
        records = encode_anchor(
            self.snapshot.items(), version=version, config=self.config, differ=self._differ
        )
        try:
            size = self.sink.send_recovery(header, stamp(records, self.run, self.epoch))
        except LeaseLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("recovery anchor for v%d not written: %s", version, exc)
            return 0
        self._since_recovery = 0
        return size

    def audit(self) -> list[str]:
        """Sum the snapshot in full against the sums the deltas moved (what they cannot see:
        a word damaged where no delta wrote). Returns the tensors that do not match; when there
        are any, the next publish is an anchor, which rewrites the snapshot."""
        from modal_rl.weightsync.codec.chunk_sums import held_sums

        with self._lock:
            self.last_audit = time.monotonic()
            if self.version is None or self._force_anchor:
                return []  # nothing whole to check: the next publish rewrites it anyway
            actual = held_sums(self.snapshot)
            damaged = sorted(name for name, s in actual.items() if self.checksums.get(name) != s)
            self.audit_damaged = damaged
            if damaged:
                self._force_anchor = True
                log.warning(
                    "weight-sync audit: the publisher's snapshot no longer matches its sums in %d "
                    "tensors (%s); the next version goes out as an anchor",
                    len(damaged),
                    ", ".join(damaged[:3]),
                )
            return damaged

    def _audit_if_due(self) -> None:
        """Start an audit on a thread of its own (the trainer goes on; the next publish waits
        for it) when ``audit_every_s`` has passed since the last one."""
        every = self.audit_every_s
        if every is None or time.monotonic() - self.last_audit < every:
            return
        if self._audit_thread is not None and self._audit_thread.is_alive():
            return
        self.last_audit = time.monotonic()
        self._audit_thread = threading.Thread(target=self.audit, name="weight-sync-audit", daemon=True)
        self._audit_thread.start()

    def wait_audit(self, timeout: float | None = None) -> None:
        """Wait for an audit started by ``publish`` (tests, shutdown)."""
        if self._audit_thread is not None:
            self._audit_thread.join(timeout)
