"""``modal_delta``: a verl checkpoint engine on ``modal_rl.weightsync`` (codec + TCP transport).

The trainer's rank 0 publishes each weight update as one verified frame — a compressed
anchor now and then, lossless deltas against the previous version otherwise — on a
``FrameServer``; every rollout worker holds a ``Subscriber`` that rebuilds the frame into its
staging state, checks every tensor against the sender's ls128 sum, and only then yields the
tensors to verl's stock rollout adapter (``wire_format = "named_tensors"``).

How verl drives it (``CheckpointEngineManager.update_weights``, every sync):
``prepare()`` on all workers → ``build_topology(...)`` → ``init_process_group(**kwargs)``
→ ``send_weights`` (actor) ‖ ``receive_weights`` (rollout) → ``finalize()``.

Invariants:
- wire versions follow verl's ``global_steps`` — ``max(global_steps, last + 1)``, so they
  strictly increase even where a step repeats or is None — which makes a trainer restarted
  from a checkpoint (``trainer.resume_mode``: verl restores ``global_steps`` and syncs it
  first) resume its numbering at the restored step; every engine instance (one trainer
  start) publishes in an epoch of its own and starts it with an anchor, and receivers order
  what they hold by (epoch, version) (``modal_rl.weightsync.wire.epoch``), so a restarted
  trainer's versions never collide with what they hold;
- the master announces in ``prepare()`` the epoch and the lowest version it will publish;
  each receiver's target is ``max(announced, global_steps)`` of that epoch, the same number
  the master computes, so it knows exactly which version ends this sync and catches up to it
  (a late or restarted receiver gets the newest anchor — wire or recovery
  (``recovery_every``) — and the deltas after it);
- ``receive_weights`` yields nothing until the target version is staged and verified: a
  refused frame (corrupt, truncated, wrong base) leaves the receiver's staged state and
  the rollout's weights unchanged; after ``max_refusals`` refusals it raises
  ``ModalDeltaSyncError`` naming the last refusal;
- the frame server and the receivers' staged state live across syncs (``finalize`` keeps
  them): that is what makes deltas possible; ``close()`` releases them;
- everything is keyed by the run's key (``MODAL_RL_RUN_KEY``, which the launchers put in
  every process of a run): the frame server admits only receivers that prove it (and proves
  it back), every record carries a MAC checked before it is staged; a process without the
  key fails with the fix (``MissingRunKeyError``). The traffic stays on the cluster's
  private network, so it is not encrypted (see docs/weight-sync.md);
- ``sharded=True``: every actor rank runs its own keyed frame server and publishes only the
  parameters it holds (verl's shard export, no gather); every rollout worker reads all of
  them and yields a version only when every rank staged it (``verl_modal.sharded``);
- a relay (``modal_vllm``'s relay worker, ``verl_modal.replica_weights``) calls
  :func:`keep_verified_frames` in its process; receivers there then keep each frame's raw
  records as they arrive and, once a sync's target is staged, hand the frames the chain
  accepted (those it refused are dropped) to :func:`take_verified_frames`, so the relay
  forwards the trainer's frames to its engines instead of encoding them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.errors import VersionNotReachedError, WeightSyncError
from modal_rl.weightsync.publisher import SNAPSHOT_PLACES, Publisher
from modal_rl.weightsync.subscriber import Subscriber, tcp_subscriber
from modal_rl.weightsync.transport.base import gbps
from modal_rl.weightsync.transport.tcp import FrameServer

log = logging.getLogger(__name__)

BACKEND = "modal_delta"
METRIC_PREFIX = "checkpoint_engine/"


_relaying = False  # keep_verified_frames() ran in this process
_receivers: list = []  # receiver engines of this process (weak references), for take_verified_frames


def keep_verified_frames() -> None:
    """From now on, receivers in this process keep the frames they verify (a relay)."""
    global _relaying
    _relaying = True


def take_verified_frames() -> list[list[tuple[bytes, bytes]]]:
    """The frames receivers in this process verified since the last call, in order, each as
    its ``(tag, raw record)`` pairs."""
    out = []
    for ref in list(_receivers):
        engine = ref()
        if engine is None:
            _receivers.remove(ref)
            continue
        out += engine._verified
        engine._verified = []
    return out


class ModalDeltaSyncError(WeightSyncError):
    """A sync did not reach its target version; the receiver's weights are unchanged."""


def _endpoint(meta: Any) -> dict | None:
    return meta.get("endpoint") if isinstance(meta, dict) else None


@CheckpointEngineRegistry.register(BACKEND)
class ModalDeltaCheckpointEngine(CheckpointEngine):
    """Delta weight sync over TCP. Constructor kwargs come from
    ``rollout.checkpoint_engine.engine_kwargs.modal_delta`` (plus ``bucket_size`` and, on the
    trainer, ``is_master`` from verl).

    Args:
        bucket_size: verl's bucket size; unused (frames are streamed record by record).
        is_master: trainer rank 0, the one that publishes. verl passes it (True or False)
            to the trainer's engines only; None marks a rollout worker's engine.
        anchor_every: a full anchor on the wire every K versions (the rest are deltas); 0
            or None: only the first of each epoch.
        recovery_every: a recovery anchor (kept for receivers that catch up, not sent to
            live ones) every K versions without an anchor; None: none.
        bind_host / port: where the master's frame server listens (port 0: any free one).
        advertise_host: the address receivers dial; defaults to ``bind_host`` (for a
            wildcard bind, the Ray node's IP).
        rate_gbps: optional cap on the master's outgoing rate (models a WAN link).
        receive_timeout_s: how long a receiver waits for the target version.
        max_refusals: refused frames tolerated per sync (each one reconnects and asks again,
            which heals corruption on the wire) before the sync fails.
        codec_threads: encode/decode threads.
        compare_merged: LoRA runs (the adapter alone is synced, ``verl_modal.lora``): also encode
            the merged weights of each version, sent nowhere, and report their bytes
            (``checkpoint_engine/merged_payload_mbytes``): a measurement, it costs a merge and
            an encode per sync.
        sharded: every actor rank publishes its own shard of the weights, from verl's shard
            export (``get_per_tensor_param_shard``), and nothing is gathered; rollout workers
            put the ranks' pieces back together (``verl_modal.sharded``). Dim-0 (FSDP2
            ``Shard(0)``) layouts only; another placement fails naming the parameter.
        snapshot_on: where a publishing rank keeps its snapshot: ``host`` (pinned memory for GPU
            weights, diffed on the CPU) or ``device`` (beside the weights, diffed there: only
            changed words cross to the host); see ``modal_rl.weightsync.publisher``.
        dtype: publish floating tensors in this dtype (the rollout's, e.g. ``bfloat16``) instead
            of the trainer's (float32 on a CPU or FSDP actor). An engine that writes versions in
            place needs records in its own dtype (it holds no float32 copy to apply float32
            words to) and reloads every tensor otherwise; the cast is the one the engine's
            loader would make, and a bf16 delta also carries half the words. None: as yielded.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool | None = None,
        *,
        anchor_every: int | None = 16,
        recovery_every: int | None = None,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        rate_gbps: float | None = None,
        receive_timeout_s: float = 600.0,
        max_refusals: int = 2,
        codec_threads: int | None = None,
        compare_merged: bool = False,
        sharded: bool = False,
        snapshot_on: str = "host",
        dtype: str | None = None,
    ) -> None:
        self.dtype = publish_dtype(dtype)
        if max_refusals < 0:
            raise ValueError(f"max_refusals must be >= 0, got {max_refusals}")
        if snapshot_on not in SNAPSHOT_PLACES:
            raise ValueError(f"modal_delta.snapshot_on must be one of {SNAPSHOT_PLACES}, got {snapshot_on!r}")
        self.snapshot_on = snapshot_on
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.trainer = is_master is not None  # verl passes is_master to the actor's engines only
        self.sharded = bool(sharded)
        self.wants_training_engine = self.sharded  # verl with patches/verl/0009 reads it
        self.anchor_every = anchor_every or None
        self.recovery_every = recovery_every or None
        self.bind_host, self.port, self.advertise_host = bind_host, port, advertise_host
        self.rate_gbps = rate_gbps
        self.receive_timeout_s = receive_timeout_s
        self.max_refusals = max_refusals
        self.config = CodecConfig(threads=codec_threads) if codec_threads else CodecConfig()
        self.compare_merged = bool(compare_merged)  # LoRA runs: also measure merged weights (verl_modal.lora)
        self.rank: int | None = None
        self.endpoint: dict | None = None  # the master's {"host", "port", "version"} for this sync
        self.metrics: dict[str, float] = {}  # last sync's numbers, on either side
        self._server: FrameServer | None = None
        self._publisher: Publisher | None = None
        self._subscriber: Subscriber | None = None
        self._shadow: Publisher | None = None  # measure(): a publisher whose frames go nowhere
        self._pull = None  # sharded receivers: a verl_modal.sharded.ShardedPull over every actor rank
        self._frame: list[tuple[bytes, bytes]] = []  # relays: the frame arriving now, raw records
        self._complete: list[list[tuple[bytes, bytes]]] = []  # relays: whole frames, not yet verified
        self._verified: list[list[tuple[bytes, bytes]]] = []  # relays: accepted, not yet taken

    # -- topology ----------------------------------------------------------------------
    def _ensure_server(self) -> None:
        if self._server is None:
            self._server = FrameServer(self.bind_host, self.port, rate_bytes_per_s=gbps(self.rate_gbps))
            self._publisher = Publisher(
                self._server,
                anchor_every=self.anchor_every,
                recovery_every=self.recovery_every,
                config=self.config,
                snapshot_on=self.snapshot_on,
            )

    def _advertised(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host in ("0.0.0.0", "::", ""):
            import ray

            return ray.util.get_node_ip_address()
        return self.bind_host

    def prepare(self) -> dict[str, Any]:
        """Master (every actor rank when sharded): start the frame server once and announce
        where it is and which version this sync publishes. Everyone else: nothing."""
        sharded = self.sharded and self.trainer
        if not (self.is_master or sharded):
            return {"endpoint": None}
        self._ensure_server()
        last = self._publisher.version
        endpoint = {
            "host": self._advertised(),
            "port": int(self._server.address[1]),
            "version": 0 if last is None else last + 1,
            "epoch": self._publisher.epoch,
        }
        return {"endpoint": {**endpoint, "sharded": True} if sharded else endpoint}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 publishes; other actor ranks only walk their weight generator (rank
        -1); every rollout worker subscribes to rank 0's endpoint."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(
                f"{BACKEND}: expected {actor_wg_world_size + rollout_world_size} prepare() results, "
                f"got {len(metadata)}"
            )
        endpoint = _endpoint(metadata[0]) if metadata else None
        if endpoint is not None and endpoint.get("sharded"):
            from verl_modal import sharded

            return sharded.topology(BACKEND, actor_wg_world_size, rollout_world_size, metadata)
        if endpoint is None:
            raise ValueError(
                f"{BACKEND}: actor rank 0 must be the master (its prepare() announced no endpoint)"
            )
        others = [i for i, m in enumerate(metadata) if i > 0 and _endpoint(m) is not None]
        if others:
            raise ValueError(
                f"{BACKEND}: only actor rank 0 may publish, but workers {others} announced endpoints"
            )
        actor = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "endpoint": [endpoint] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, rollout_world_size + 1)),
            "endpoint": [endpoint] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, endpoint: dict) -> None:
        """Receivers (rank >= 1) connect to the master once and keep the connection and their
        staged state across syncs."""
        self.rank, self.endpoint = rank, endpoint
        if endpoint.get("sharded"):
            from verl_modal import sharded

            if rank < 1:
                self._publisher = sharded.shared_epoch_publisher(self, endpoint) or self._publisher
            elif self._pull is None or not self._pull.connect(endpoint):
                if self._pull is not None:
                    self._pull.close()
                self._pull = sharded.ShardedPull(endpoint, self.config)
            return
        if rank < 1:
            return
        addr = (endpoint["host"], int(endpoint["port"]))
        self._subscriber = tcp_subscriber(
            self._subscriber, addr, endpoint["version"], self.config, epoch=endpoint.get("epoch")
        )
        if _relaying:
            self._keep_records()

    def _keep_records(self) -> None:
        import weakref

        if not any(ref() is self for ref in _receivers):
            _receivers.append(weakref.ref(self))
        self._subscriber.source.on_record = self._on_record  # a new source when the server moved

    def _on_record(self, tag: bytes, raw: bytes) -> None:
        from modal_rl.weightsync.wire.frames import TAG_END, TAG_VERSION

        if tag.upper() == TAG_VERSION:
            self._frame = []
        self._frame.append((tag, raw))
        if tag.upper() == TAG_END:
            self._complete.append(self._frame)
            self._frame = []

    def _keep_accepted(self, timings) -> None:
        """Move the frames the chain accepted (one per timing, the last whole frame of that
        version: an earlier one of the same version was refused) to ``_verified``."""
        from modal_rl.weightsync.wire.frames import VersionHeader, record_body

        def position(frame) -> tuple[int, int]:
            header = VersionHeader.from_body(record_body(frame[0][1]))
            return (header.epoch, header.version)

        complete, self._complete = self._complete, []
        by_position = {position(f): f for f in complete}  # later frames of a position win
        for t in timings:
            frame = by_position.get((t.epoch, t.version))
            if frame is None:  # received before relaying began: what the relay lacks stays unforwarded
                continue
            self._verified.append(frame)

    def finalize(self) -> None:
        """Per-sync cleanup: nothing to free — the server's retained frames and the receivers'
        staged state are the bases of the next delta."""
        self.endpoint = None

    def close(self) -> None:
        """Release the frame server and the receiver's connection (end of the run)."""
        if self._server is not None:
            self._server.close()
            self._server = self._publisher = None
        if self._subscriber is not None:
            self._subscriber.source.close()
            self._subscriber = None
        if self._shadow is not None:
            self._shadow.sink.close()
            self._shadow = None
        if self._pull is not None:
            self._pull.close()
            self._pull = None

    # -- trainer side ------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, float]:
        """Publish one version from ``weights`` ((name, tensor) pairs, sync or async; with
        ``sharded``, verl's training engine, whose local shards this rank publishes).
        Returns verl metrics (the manager merges the actor workers' return values)."""
        if self.sharded:
            from verl_modal.sharded import check_layout, local_pieces

            self._ensure_server()
            if self._publisher.version is None and hasattr(weights, "get_per_tensor_param_shard"):
                check_layout(weights)  # placements are fixed for a run: the first sync checks them
            return self._publish(local_pieces(weights), global_steps)
        if not self.is_master:
            # Producing each tensor may be collective over the actor group: walk it anyway.
            if hasattr(weights, "__aiter__"):
                async for _ in weights:
                    pass
            else:
                for _ in weights:
                    pass
            return {}
        self._ensure_server()
        if hasattr(weights, "__aiter__"):
            pairs = _synced(weights, asyncio.get_running_loop())
            return await asyncio.to_thread(self._publish, pairs, global_steps)
        # In the caller's thread: the generator may run collectives bound to this thread.
        return self._publish(weights, global_steps)

    def _publish(self, pairs, global_steps: int | None) -> dict[str, float]:
        floor = self._publisher.next_version if self.endpoint is None else self.endpoint["version"]
        expected = _target(floor, global_steps)
        if self.dtype is not None:
            pairs = cast_floats(pairs, self.dtype)
        t0 = time.perf_counter()
        report = self._publisher.publish(pairs, expected)
        seconds = time.perf_counter() - t0
        self.metrics = {
            f"{METRIC_PREFIX}version": float(report.version),
            f"{METRIC_PREFIX}anchor": 1.0 if report.kind == "anchor" else 0.0,
            f"{METRIC_PREFIX}payload_mbytes": report.bytes / (1 << 20),
            f"{METRIC_PREFIX}raw_mbytes": report.raw_bytes / (1 << 20),
            f"{METRIC_PREFIX}compression_ratio": report.raw_bytes / max(report.bytes, 1),
            f"{METRIC_PREFIX}send_s": seconds,
        }
        log.info(
            "%s sent v=%d (%s, global_steps=%s) %.2f MiB in %.2fs",
            BACKEND,
            report.version,
            report.kind,
            global_steps,
            report.bytes / (1 << 20),
            seconds,
        )
        return dict(self.metrics)

    def measure(self, weights, prefix: str) -> dict[str, float]:
        """What ``weights`` would cost as this engine's next frame, encoded by a shadow
        publisher of its own (the same codec, anchors and deltas; a frame server nobody
        dials, so the frames go nowhere): ``checkpoint_engine/<prefix>payload_mbytes`` etc.
        Every rank walks ``weights`` (producing them may be collective); the master encodes."""
        if not self.is_master:
            for _ in weights:
                pass
            return {}
        if self._shadow is None:
            self._shadow = Publisher(
                FrameServer("127.0.0.1", 0), anchor_every=self.anchor_every, config=self.config
            )
        report = self._shadow.publish(weights)
        p = METRIC_PREFIX + prefix
        return {
            p + "payload_mbytes": report.bytes / (1 << 20),
            p + "raw_mbytes": report.raw_bytes / (1 << 20),
            p + "anchor": 1.0 if report.kind == "anchor" else 0.0,
        }

    # -- rollout side ------------------------------------------------------------------
    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Stage and verify the version announced for this sync (or, without an announcement,
        the next one), then yield every tensor of it. Network reads and decoding run in a
        thread so the worker's event loop stays responsive. Yielded tensors are the staged
        state itself: read them, do not modify them."""
        if self._pull is not None:
            await asyncio.to_thread(self._stage_shards, global_steps)
            for name, tensor in self._pull.tensors():
                yield name, tensor
            return
        if self._subscriber is None:
            raise ModalDeltaSyncError(
                f"{BACKEND}: receive_weights before init_process_group (no master endpoint)"
            )
        state = await asyncio.to_thread(self._stage, global_steps)
        for name, tensor in state.items():
            yield name, tensor

    def _stage(self, global_steps: int | None = None) -> dict[str, torch.Tensor]:
        sub = self._subscriber
        held = sub.live_version
        if self.endpoint:
            target, epoch = _target(self.endpoint["version"], global_steps), self.endpoint.get("epoch")
        else:
            target, epoch = (0 if held is None else held + 1), None
        refused_before = len(sub.refused)
        if _relaying:
            self._keep_records()
        try:
            timings = sub.stage_until(target, self.receive_timeout_s, self.max_refusals, epoch=epoch)
        except VersionNotReachedError as exc:
            raise ModalDeltaSyncError(f"{BACKEND}: {exc}") from exc
        if _relaying:
            self._keep_accepted(timings)
        self.metrics = {
            f"{METRIC_PREFIX}version": float(sub.live_version),
            f"{METRIC_PREFIX}frames": float(len(timings)),
            f"{METRIC_PREFIX}payload_mbytes": sum(t.bytes for t in timings) / (1 << 20),
            f"{METRIC_PREFIX}fetch_s": sum(t.fetch_s for t in timings),
            f"{METRIC_PREFIX}decode_s": sum(t.decode_s for t in timings),
            f"{METRIC_PREFIX}refused": float(len(sub.refused) - refused_before),
        }
        return sub.chain.state

    def _stage_shards(self, global_steps: int | None) -> None:
        target = _target(self.endpoint["version"], global_steps) if self.endpoint else 0
        epoch = self.endpoint.get("epoch") if self.endpoint else None
        try:
            numbers = self._pull.stage(target, epoch, self.receive_timeout_s, self.max_refusals)
        except WeightSyncError as exc:  # refusals, the deadline, pieces that do not tile
            raise ModalDeltaSyncError(f"{BACKEND}: {exc}") from exc
        self.metrics = {METRIC_PREFIX + k: v for k, v in numbers.items()}


def _target(floor: int, global_steps: int | None) -> int:
    """The version a sync publishes: verl's step when it moves forward, else the next number."""
    if isinstance(global_steps, int) and not isinstance(global_steps, bool) and global_steps > floor:
        return global_steps
    return floor


def publish_dtype(name: str | None, setting: str = "modal_delta.dtype") -> torch.dtype | None:
    """``setting``'s value: a floating torch dtype by name, or None."""
    if name is None:
        return None
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{setting}={name!r} is not a floating torch dtype; use the engine's, e.g. bfloat16")
    return dtype


def cast_floats(pairs, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs with floating tensors in ``dtype`` (the cast an engine's loader
    would make); other tensors as they are."""
    for name, tensor in pairs:
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _synced(agen, loop: asyncio.AbstractEventLoop) -> Iterator[tuple[str, torch.Tensor]]:
    """Pull an async iterator from a worker thread, one item at a time, on its own loop."""
    it = agen.__aiter__()
    while True:
        try:
            yield asyncio.run_coroutine_threadsafe(it.__anext__(), loop).result()
        except StopAsyncIteration:
            return
