"""``modal_delta`` with ``sharded: true``: every actor rank publishes the parameters it holds.

verl's own shard export (``BaseEngine.get_per_tensor_param_shard``: ``(name, local_shard,
ShardSpec)`` per parameter, no all-gather) is translated here into the pieces of
``modal_rl.weightsync.shards`` (``name@start:(full shape)``: a flat element range of the
full checkpoint tensor). Each actor rank publishes its pieces through its own frame server;
every rollout worker reads all ranks' streams with a ``ShardedReceiver`` and yields full
tensors to verl's rollout adapter.

Invariants:
- no rank ever gathers: a parameter whose placement is not one flat range of the full
  tensor (``Shard(d > 0)``, a TP x FSDP block, a converter spec) fails before anything is
  sent, with one line naming the parameter and the fix (``sharded: false``);
- each element is published by exactly one rank: a sharded parameter by each rank holding a
  block at coordinate 0 of every ``Replicate`` mesh dim (verl's ``derive_dtensor_placement``
  says which: the lowest rank of each replica group), a replicated or plain tensor by the
  lowest such rank (mesh coordinate 0; global rank 0 for a plain tensor); a rank holding no
  element of a tensor publishes nothing for it;
- all actor ranks publish one epoch, rank 0's: ``build_topology`` hands it to every rank and
  a rank that has not published yet adopts it (``shared_epoch_publisher``; no collective);
- a rollout worker yields nothing until every rank's stream staged the sync's version (of
  that epoch) and the pieces tile every tensor; a refused frame or a layout that does not
  tile leaves what the rollout serves unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.shards import PieceMap, ShardedReceiver, ShardLayoutError, assembled, piece_name

FIX = "set rollout.checkpoint_engine.engine_kwargs.modal_delta.sharded=false"


class ShardedExportError(ShardLayoutError):
    """A parameter the sharded path cannot publish without a gather (see ``FIX``)."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# -- trainer side -------------------------------------------------------------------------
def piece_start(name: str, local: Any, spec: Any) -> int | None:
    """Where ``local`` starts in the full tensor ``spec`` describes (flat element index), or
    None when this rank does not publish it (a replica another rank publishes, no elements)."""
    from verl.workers.engine.spec import derive_dtensor_placement

    if getattr(spec, "to_hf_chunk", None) is not None or getattr(spec, "hf_slots", None) is not None:
        raise ShardedExportError(
            f"{name}: its shard comes with a converter to other checkpoint tensors, which sharded "
            f"publishing does not run; {FIX}"
        )
    full = tuple(int(d) for d in spec.full_shape)
    if spec.place is not None:  # the exporter's own placement (e.g. a manual expert split)
        place, contributes = spec.place, spec.contributes
    else:
        try:
            place, contributes, _group = derive_dtensor_placement(spec)
        except NotImplementedError as exc:
            raise ShardedExportError(f"{name}: {exc}; {FIX}") from None
    if not contributes:
        return None
    if isinstance(place, int):
        start, numel = int(place), local.numel()
    elif place.is_flat_contiguous:
        start, numel = place.flat_offset, math.prod(place.local_shape)
    else:
        raise ShardedExportError(
            f"{name}: placements {tuple(spec.placements or ())} give this rank a block "
            f"{tuple(place.local_shape)} at {tuple(place.global_offset)} of {full}, not a flat range "
            f"(only dim-0 shards such as FSDP2 Shard(0) are); {FIX}"
        )
    if numel != local.numel() or start + numel > math.prod(full):
        raise ShardedExportError(
            f"{name}: the local shard holds {local.numel()} elements where its spec places "
            f"{numel} at {start} of {full}; {FIX}"
        )
    if not numel:  # nothing held; an empty tensor itself is rank 0's, whole
        return 0 if not math.prod(full) and _rank() == 0 else None
    return start


def local_pieces(weights: Any) -> Iterator[tuple[str, Any]]:
    """This rank's pieces: from a training engine (``get_per_tensor_param_shard()``) or from
    its ``(name, local_shard, ShardSpec)`` triples. Full ``(name, tensor)`` pairs are refused:
    verl gathered them (its ``update_weights`` sent ``get_per_tensor_param()``)."""
    if hasattr(weights, "get_per_tensor_param_shard"):
        weights, _peft = weights.get_per_tensor_param_shard()
    for item in weights:
        if len(item) != 3:
            raise ShardedExportError(
                "sharded: true, but this rank was handed gathered full tensors instead of the "
                "training engine (is verl_modal's update_weights hook installed? see "
                f"verl_modal.lora); {FIX} or load the verl_modal plugin"
            )
        name, local, spec = item
        start = piece_start(name, local, spec)
        if start is not None:
            yield piece_name(name, start, spec.full_shape), local.detach().reshape(-1)


async def send_shards(worker: Any, global_steps: int | None, lora: bool) -> dict[str, float]:
    """The actor worker's sync for a sharded ``modal_delta`` engine (``verl_modal.lora``'s
    ``update_weights`` wrapper): the checkpoint engine reads the training engine's shards."""
    if lora:
        raise ShardedExportError(
            "sharded: true with a LoRA adapter run: the adapter is published whole by rank 0 "
            f"(it is small); {FIX}"
        )
    metrics = await worker.checkpoint_engine.send_weights(worker.actor.engine, global_steps=global_steps)
    return dict(metrics or {})


def check_layout(engine: Any) -> None:
    """Walk ``engine``'s shard export once and check every placement (``piece_start``), so an
    unsupported one fails before the first frame is sent rather than in the middle of it."""
    exported, _peft = engine.get_per_tensor_param_shard()
    for name, local, spec in exported:
        piece_start(name, local, spec)


def shared_epoch_publisher(engine: Any, endpoint: dict) -> Publisher | None:
    """The publisher an actor rank uses to publish the run's shared epoch (rank 0's), made
    before its first frame; None when its own already does."""
    publisher, epoch = engine._publisher, endpoint["epoch"]
    if publisher is None or publisher.epoch == epoch:
        return None
    if publisher.version is not None:
        raise ShardedExportError(
            f"this actor rank publishes epoch {publisher.epoch:x} but rank 0 publishes {epoch:x}: "
            "the actor ranks were not started together; restart the trainer"
        )
    return Publisher(
        engine._server,
        anchor_every=engine.anchor_every,
        recovery_every=engine.recovery_every,
        config=engine.config,
        epoch=epoch,
        snapshot_on=engine.snapshot_on,
    )


def topology(
    backend: str, actor_world: int, rollout_world: int, metadata: list[dict]
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Every actor rank publishes (rank 0 for all of them: none subscribes); every rollout
    worker gets every actor endpoint, in actor rank order, with rank 0's epoch and the
    highest version announced (the ranks publish in lockstep, so normally all the same)."""
    announced = [m.get("endpoint") if isinstance(m, dict) else None for m in metadata[:actor_world]]
    missing = [r for r, ep in enumerate(announced) if not (ep and ep.get("sharded"))]
    if missing:
        raise ValueError(
            f"{backend}: sharded publishing needs every actor rank's endpoint, ranks {missing} "
            "announced none (set sharded the same on every worker)"
        )
    rollout_eps = [i for i, m in enumerate(metadata[actor_world:], actor_world) if m.get("endpoint")]
    if rollout_eps:
        raise ValueError(
            f"{backend}: only actor ranks publish, but workers {rollout_eps} announced endpoints"
        )
    shared = {
        "sharded": True,
        "endpoints": [{"host": ep["host"], "port": int(ep["port"])} for ep in announced],
        "version": max(int(ep["version"]) for ep in announced),
        "epoch": announced[0]["epoch"],
    }
    actor = {"rank": [0] * actor_world, "endpoint": [shared] * actor_world}
    rollout = {"rank": list(range(1, rollout_world + 1)), "endpoint": [shared] * rollout_world}
    return actor, rollout


# -- rollout side -------------------------------------------------------------------------
class ShardedPull:
    """A rollout worker's receiver over every actor rank's stream; kept across syncs (its
    staged pieces are the next deltas' bases)."""

    def __init__(self, endpoint: dict, config: CodecConfig) -> None:
        from modal_rl.weightsync.transport.tcp_source import TcpSource

        addrs = [(ep["host"], int(ep["port"])) for ep in endpoint["endpoints"]]
        self.addrs = addrs
        self.active: tuple[PieceMap, dict, int] | None = None  # what the rollout serves
        self.receiver = ShardedReceiver([TcpSource(h, p) for h, p in addrs], self._activate, config)

    def _activate(self, pieces: PieceMap, layout: dict, version: int) -> None:
        self.active = (pieces, layout, version)

    def connect(self, endpoint: dict) -> bool:
        """Follow ``endpoint``'s ranks: a rank that moved gets a new connection (its staged
        pieces stay: the next delta's base; the run key comes from the environment, as for
        the unsharded subscriber). False when the number of ranks changed (make a new pull)."""
        from modal_rl.weightsync.transport.tcp_source import TcpSource

        addrs = [(ep["host"], int(ep["port"])) for ep in endpoint["endpoints"]]
        if len(addrs) != len(self.addrs):
            return False
        for sub, old, new in zip(self.receiver.subscribers, self.addrs, addrs, strict=True):
            if old != new:
                sub.source.close()
                sub.source = TcpSource(*new)
        self.addrs[:] = addrs
        return True

    def stage(self, target: int, epoch: int | None, timeout_s: float, max_refusals: int) -> dict:
        """Stage ``target`` from every rank and make it what ``tensors`` yields; raises
        ``VersionNotReachedError`` (refusals, deadline) with nothing changed."""
        from modal_rl.weightsync.errors import VersionNotReachedError

        self.active = None  # the ranks' staged pieces move now: only a completed stage yields
        subs = self.receiver.subscribers
        refused = sum(len(s.refused) for s in subs)
        before = [len(s.timings) for s in subs]
        if not self.receiver.run_until(target, timeout_s, epoch=epoch, max_refusals=max_refusals):
            raise VersionNotReachedError(f"version {target} did not arrive from every actor rank")
        new = [t for s, n in zip(subs, before, strict=True) for t in s.timings[n:]]
        return {
            "version": float(self.receiver.live_version),
            "frames": float(len(new)),
            "payload_mbytes": sum(t.bytes for t in new) / (1 << 20),
            "fetch_s": sum(t.fetch_s for t in new),
            "decode_s": sum(t.decode_s for t in new),
            "refused": float(sum(len(s.refused) for s in subs) - refused),
            "ranks": float(len(subs)),
        }

    def tensors(self) -> Iterable[tuple[str, Any]]:
        """The full tensors of the version the last ``stage`` activated (nothing after a failed
        one), one at a time (``shards.assembled``). Read them before the next ``stage``."""
        if self.active is None:
            return
        pieces, layout, _version = self.active
        yield from assembled(pieces, layout)

    def close(self) -> None:
        self.receiver.close()
