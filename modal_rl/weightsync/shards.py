"""Sharded publishing: every trainer rank sends the changes of what it holds, in checkpoint
coordinates; a receiver puts the ranks' pieces back together. Nothing is gathered.

Coordinates. A rank's *piece* of a checkpoint tensor is the flat element range
``[start, start + numel)`` of the full tensor in row-major order. A dim-0 shard is exactly
that: FSDP2's ``Shard(0)`` local tensor (``torch.chunk`` along dim 0), a Megatron
pipeline stage's whole tensors (start 0). On the wire a piece is an ordinary tensor of its
rank's frames, named ``piece_name(name, start, full_shape)``; the name is inside the signed
frame, so a piece's coordinates are authenticated like its words, and the engine map (which
speaks checkpoint names and flat positions) can place it without a full tensor.

Invariants:
- a rank's ``Publisher`` holds a snapshot of its own pieces only, never the full model;
- each rank publishes through its own sink as an ordinary stream (anchors, deltas, recovery
  anchors, checksums per piece); the ranks share one epoch (rank 0 draws it);
- a ``ShardedReceiver`` activates version v only when every rank's stream has staged v **of
  one epoch** (checked whether or not the caller names an epoch: a version made of rank 0 at
  one trainer start and rank 1 at another is no state of any trainer) and the pieces of every tensor tile it exactly (no gap, no overlap, one dtype, one full
  shape); until then its live weights stay at the version before: all ranks or none;
- a piece name that does not parse, or pieces that do not tile, are refused
  (``ShardLayoutError``) before anything is activated.

Memory: a rank publisher holds one snapshot of its shard (``Publisher``); a receiver holds
every rank's staged pieces (one copy of the model) plus what its activation writes into.
"""

from __future__ import annotations

import math
import operator
import re
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.errors import WeightSyncError
from modal_rl.weightsync.subscriber import Subscriber
from modal_rl.weightsync.transport.base import FrameSource
from modal_rl.weightsync.wire.epoch import position

_PIECE = re.compile(
    r"(?P<name>.+)@(?P<start>[0-9]{1,19}):\((?P<shape>(?:[0-9]{1,19}(?:,[0-9]{1,19}){0,15})?)\)"
)


class ShardLayoutError(WeightSyncError):
    """The ranks' pieces do not describe one state: a name that is not a piece, a gap, an
    overlap, or two pieces of one tensor that disagree on its dtype or full shape."""


@dataclass(frozen=True)
class Piece:
    name: str  # the checkpoint tensor's name
    start: int  # first flat element of the full tensor held
    full_shape: tuple[int, ...]

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)


def piece_name(name: str, start: int, full_shape: Sequence[int]) -> str:
    return f"{name}@{start}:({','.join(str(int(d)) for d in full_shape)})"


def parse_piece(piece: str) -> Piece:
    m = _PIECE.fullmatch(piece)
    if m is None:
        raise ShardLayoutError(
            f"tensor {piece[:80]!r} is not a shard piece (name@start:(shape)); was it published by a sharded publisher?"
        )
    shape = tuple(int(d) for d in m["shape"].split(",")) if m["shape"] else ()
    return Piece(m["name"], int(m["start"]), shape)


def dim0_pieces(state: Iterable[tuple[str, Any]], rank: int, world: int) -> Iterator[tuple[str, Any]]:
    """The pieces ``rank`` of ``world`` holds of full tensors sharded along dim 0 as FSDP2 does
    (``torch.chunk``: ceil(rows / world) rows per rank, the last ranks may hold fewer or
    none); a 0-dim or empty tensor is held whole by rank 0. Each piece is a view of the given tensor."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    for name, tensor in state:
        shape = tuple(int(d) for d in tensor.shape)
        if not shape or not tensor.numel():  # a scalar or an empty tensor: rank 0's, whole
            if rank == 0:
                yield piece_name(name, 0, shape), tensor
            continue
        lo, hi = _dim0_rows(shape[0], rank, world)
        if lo < hi:
            row = math.prod(shape[1:])
            yield piece_name(name, lo * row, shape), tensor[lo:hi]


def _dim0_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` rank ``rank`` of ``world`` holds under ``torch.chunk`` along
    dim 0 (FSDP2's ``Shard(0)``): ceil(rows / world) each, the last ranks fewer or none."""
    step = -(-rows // world)
    return min(rank * step, rows), min((rank + 1) * step, rows)


def dtensor_pieces(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The pieces this rank holds of a model's parameters as FSDP2 shards them (``DTensor``
    with one ``Shard(0)`` placement on a 1-D mesh): the local tensor, no gather. A
    replicated DTensor or a plain tensor is sent by mesh rank 0 only. Other layouts (TP
    ``Shard(d > 0)``, 2-D meshes) are refused by name: their pieces are not flat ranges."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for name, tensor in named:
        if not isinstance(tensor, DTensor):
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0:
                yield piece_name(name, 0, tuple(tensor.shape)), tensor.detach()
            continue
        mesh, placements = tensor.device_mesh, tensor.placements
        full = tuple(int(d) for d in tensor.shape)
        if mesh.ndim != 1 or len(placements) != 1:
            raise ShardLayoutError(
                f"{name}: a {mesh.ndim}-D mesh is not sharded publishing's layout yet (1-D Shard(0) only)"
            )
        placement, coordinate = placements[0], mesh.get_local_rank()
        local = tensor.to_local().detach()
        if isinstance(placement, Replicate):
            if coordinate == 0:
                yield piece_name(name, 0, full), local
        elif isinstance(placement, Shard) and placement.dim == 0:
            lo = _dim0_rows(full[0], coordinate, mesh.size())[0] if full else 0
            if local.numel() or (coordinate == 0 and not math.prod(full)):
                yield piece_name(name, lo * math.prod(full[1:]), full), local
        else:
            raise ShardLayoutError(
                f"{name}: placement {placement} is not a dim-0 shard; publish it from a Shard(0) layout"
            )


PieceMap = dict[str, list[tuple[int, Any]]]  # checkpoint name -> [(flat start, piece)], by start


def tile(states: Sequence[dict[str, Any]]) -> tuple[PieceMap, dict[str, tuple[tuple[int, ...], Any]]]:
    """Every rank's staged pieces by checkpoint name, checked to tile each tensor exactly.
    Returns the pieces and each tensor's (full shape, dtype)."""
    pieces: PieceMap = {}
    layout: dict[str, tuple[tuple[int, ...], Any]] = {}
    for state in states:
        for key, tensor in state.items():
            p = parse_piece(key)
            known = layout.setdefault(p.name, (p.full_shape, tensor.dtype))
            if known != (p.full_shape, tensor.dtype):
                raise ShardLayoutError(
                    f"{p.name}: pieces disagree on its layout ({known} vs {(p.full_shape, tensor.dtype)})"
                )
            pieces.setdefault(p.name, []).append((p.start, tensor))
    for name, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        at = 0
        for start, tensor in parts:
            if start != at:
                what = "overlap" if start < at else "gap"
                raise ShardLayoutError(f"{name}: the ranks' pieces {what} at element {min(start, at)}")
            at += tensor.numel()
        if at != math.prod(layout[name][0]):
            raise ShardLayoutError(
                f"{name}: the ranks' pieces cover {at} of {math.prod(layout[name][0])} elements"
            )
    return pieces, layout


def assembled(pieces: PieceMap, layout: dict) -> Iterator[tuple[str, Any]]:
    """The full tensors of tiled ``pieces``, one at a time, for a loader that takes named
    tensors: a tensor held whole by one rank is a view of its piece, the others are put
    together as they are yielded (so at most one assembled tensor exists at a time)."""
    import torch

    for name, parts in pieces.items():
        shape, _dtype = layout[name]
        if len(parts) == 1:
            yield name, parts[0][1].reshape(shape)
        else:
            yield name, torch.cat([p.reshape(-1) for _start, p in parts]).view(shape)


def assemble_into(live: dict[str, Any]) -> Callable[[PieceMap, dict, int], None]:
    """An activation that writes every piece into ``live``'s full tensors in place (made on
    the first call), as an engine's loader would."""

    def activate(pieces: PieceMap, layout: dict, version: int) -> None:
        import torch

        for name, parts in pieces.items():
            shape, dtype = layout[name]
            held = live.get(name)
            if held is None or tuple(held.shape) != shape or held.dtype != dtype:
                held = live[name] = torch.empty(shape, dtype=dtype)
            flat = held.view(-1)
            for start, piece in parts:
                flat[start : start + piece.numel()].copy_(piece.reshape(-1))

    return activate


_referent = weakref.ref.__call__  # a weak reference's object, or None once it is gone


class ShardedReceiver:
    """Takes every rank's stream (one ``FrameSource`` per rank) and activates a version
    only when all ranks have staged it (see the module's invariants)."""

    def __init__(
        self,
        sources: Sequence[FrameSource],
        activate: Callable[[PieceMap, dict, int], None],
        config: CodecConfig | None = None,
    ) -> None:
        if not sources:
            raise ValueError("a sharded receiver needs at least one rank's source")
        config = config or CodecConfig()
        self.subscribers = [Subscriber(s, lambda _state, _version: None, config=config) for s in sources]
        self.activate = activate
        self._pool = ThreadPoolExecutor(len(sources), thread_name_prefix="shard-receiver")
        self.live_version: int | None = None
        self.pause_s: list[float] = []
        # what the last tiling found, without holding a tensor alive (an anchor's old state
        # must go when the chain drops it): each rank's names, weak references to its
        # tensors, and per checkpoint name its pieces as (start, rank, index)
        self._tiled: tuple[list[list[str]], list[list[Any]], list[tuple[str, list]], dict] | None = None

    def _tile(self) -> tuple[PieceMap, dict]:
        """``tile`` of the ranks' staged states, reused while every rank holds the same names
        and the same tensor objects (deltas and in-place anchors write words, never a
        tensor's shape or dtype): then the check is two C-level list comparisons per piece
        and the piece map is rebuilt from the kept order, not parsed, checked and sorted in
        Python again. Any other name or tensor object tiles afresh."""
        states = [s.chain.state for s in self.subscribers]
        names = [list(state) for state in states]
        held = [list(state.values()) for state in states]
        kept = self._tiled
        if (
            kept is not None
            and names == kept[0]
            and all(
                len(now) == len(refs) and all(map(operator.is_, now, map(_referent, refs)))
                for now, refs in zip(held, kept[1], strict=True)
            )
        ):
            pieces = {name: [(start, held[r][k]) for start, r, k in parts] for name, parts in kept[2]}
            return pieces, kept[3]
        pieces, layout = tile(states)
        where = {id(t): (r, k) for r, tensors in enumerate(held) for k, t in enumerate(tensors)}
        order = [(name, [(start, *where[id(t)]) for start, t in parts]) for name, parts in pieces.items()]
        self._tiled = (names, [list(map(weakref.ref, tensors)) for tensors in held], order, layout)
        return pieces, layout

    def staged(self) -> list[int | None]:
        return [s.chain.version for s in self.subscribers]

    def staged_positions(self) -> list[tuple[int | None, int | None]]:
        """Each rank's staged (epoch, version): a version is activated only when all agree."""
        return [(s.chain.epoch, s.chain.version) for s in self.subscribers]

    def run_until(
        self, version: int, timeout: float, epoch: int | None = None, max_refusals: int | None = None
    ) -> bool:
        """Stage ``version`` (or a newer one; of ``epoch`` when given) from every rank, then
        activate the newest version all ranks hold. False if that did not happen within
        ``timeout``; with ``max_refusals``, a rank that refuses more frames than that or
        misses the deadline raises ``VersionNotReachedError`` instead (``Subscriber.stage_until``).
        Either way nothing is activated.

        Every rank's stream is read at once, one thread each: a stream left unread while
        another rank's frame decodes would fill its server's buffer and be dropped (and a
        server that keeps no anchor cannot resend it); the ranks' decodes overlap too."""
        deadline = time.monotonic() + timeout
        target = version
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            done = self._each(target, remaining, epoch, max_refusals)
            if not all(done):
                return False
            staged = self.staged_positions()
            if len(set(staged)) == 1:
                break
            # A rank moved on (a later version, or a newer trainer's epoch): follow it. Ranks at
            # one version of two epochs are two states, never one: the others must reach it.
            epoch, target = max(staged, key=lambda at: position(*at))
        pieces, layout = self._tile()
        t0 = time.monotonic()
        self.activate(pieces, layout, staged[0][1])
        self.pause_s.append(time.monotonic() - t0)
        self.live_version = staged[0][1]
        return True

    def _each(self, target: int, timeout: float, epoch: int | None, max_refusals: int | None) -> list[bool]:
        """Every rank's subscriber towards ``target``, one thread each; returns when all are
        done (no thread is left polling a subscriber) and raises the first failure."""

        def step(sub: Subscriber) -> bool:
            if max_refusals is None:
                return sub.run_until(target, timeout, epoch)
            sub.stage_until(target, timeout, max_refusals, epoch)
            return True

        futures = [self._pool.submit(step, s) for s in self.subscribers]
        wait(futures)
        return [f.result() for f in futures]

    def close(self) -> None:
        for sub in self.subscribers:
            sub.source.close()
        self._pool.shutdown(wait=True)
