"""Encode a policy version as a frame: a full anchor, or a lossless delta against a base.

Encoding splits every tensor into chunks of ``CodecConfig.chunk_elems`` words and runs
diff + pack per chunk on a thread pool (numpy and zstd release the GIL). Records are
yielded strictly in frame order while at most ``window`` chunks are in flight, so the extra
memory is bounded by ``window × chunk_elems`` words, whatever the model's size, and the
caller can put one tensor on the wire while later ones are still being encoded.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from modal_rl.weightsync.codec.codings.chunks import (
    MAX_CHUNK_ELEMS,
    ChunkSpec,
)
from modal_rl.weightsync.codec.decode_costs import DecodeCosts
from modal_rl.weightsync.codec.differ import Differ, NumpyDiffer, default_differ
from modal_rl.weightsync.codec.dtypes import dtype_name
from modal_rl.weightsync.codec.encode_tasks import (
    GroupSums,
    Member,
    anchor_group_record,
    delta_chunk,
    full_chunk,
    group_record,
    v2_available,
)
from modal_rl.weightsync.codec.linsum import EMPTY as EMPTY_SUM
from modal_rl.weightsync.codec.linsum import SUM_BLOCK_WORDS
from modal_rl.weightsync.codec.workers import shared_pool
from modal_rl.weightsync.errors import LayoutMismatchError
from modal_rl.weightsync.wire.dtype_codes import ITEMSIZE
from modal_rl.weightsync.wire.frames import (
    RECORD_HEADER,
    RECORD_TRAILER,
    TAG_GROUP,
    TAG_SUMS,
    EndRecord,
    VersionHeader,
    manifest_digest,
    record,
    state_digest,
    sums_body,
)

# A state dict, or the (name, tensor) pairs of one as a framework streams them.
Tensors = Mapping[str, Any] | Iterable[tuple[str, Any]]


@dataclass(frozen=True)
class CodecConfig:
    """Codec parameters. ``threads`` encode/decode chunks in parallel; ``window`` bounds the
    chunks in flight (and so the extra memory) per encode or apply call."""

    chunk_elems: int = 1 << 22
    threads: int = min(8, os.cpu_count() or 1)
    zstd_level: int = 1
    window: int = 0  # 0 = 2 × threads
    # 2: code 2-byte delta chunks with the context model (``chunks_v2``) where it pays on
    # a known link (``link_bytes_per_s``; unknown: v1, whose cost follows the changes alone);
    # 1: v1 coding only (what receivers without numba need); 0: every delta chunk as a
    # dense XOR with zstd planes — the shape of slime's xor + zstd-1 delta, carried in our
    # frames for side-by-side measurements. Readers decode all of them.
    coding: int = 2
    # Bytes per second each receiver gets on this link (None: unknown — every chunk v1,
    # never a pass over the whole state). With it, a chunk is coded v2 only where the wire time its smaller body
    # saves exceeds the extra decode time a v2 chunk costs the receiver (``chunks_v2.v2_pays``).
    # The publisher fills it in from a rate-limited sink. Changes the bytes, never decodability.
    link_bytes_per_s: float | None = None
    # What a v2 chunk costs the slowest receiver beyond v1 (``decode_costs``: measured by
    # each receiver, named in its hello; None: the defaults). Used with ``link_bytes_per_s``.
    receiver_costs: DecodeCosts | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_elems <= MAX_CHUNK_ELEMS or self.chunk_elems % SUM_BLOCK_WORDS:
            raise ValueError(
                f"chunk_elems must be a multiple of {SUM_BLOCK_WORDS} in [{SUM_BLOCK_WORDS}, {MAX_CHUNK_ELEMS}] "
                f"(a chunk never splits a checksum block), got {self.chunk_elems}"
            )
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not -7 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in [-7, 22], got {self.zstd_level}")
        if self.coding not in (0, 1, 2):
            raise ValueError(f"coding must be 0, 1 or 2, got {self.coding}")
        if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0 (or None), got {self.link_bytes_per_s}")

    def wire_params(self) -> dict[str, int]:
        """What a reader may want to know; threads and window do not change the bytes."""
        return {"chunk_elems": self.chunk_elems, "zstd_level": self.zstd_level, "coding": self.coding}

    @property
    def in_flight(self) -> int:
        return self.window or 2 * self.threads


def shape_of(tensor: Any) -> tuple[int, ...]:
    return tuple(map(int, tensor.shape))


def chunk_specs(numel: int, chunk_elems: int) -> list[ChunkSpec]:
    return [
        ChunkSpec(i, start, min(chunk_elems, numel - start))
        for i, start in enumerate(range(0, numel, chunk_elems))
    ]


def check_same_layout(base: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    if list(base) != list(new):
        missing, extra = sorted(set(new) - set(base)), sorted(set(base) - set(new))
        detail = (
            f"only in new: {missing[:3]}, only in base: {extra[:3]}" if missing or extra else "order differs"
        )
        raise LayoutMismatchError(f"base and new hold different tensors ({detail})")
    for name, tensor in new.items():
        _check_tensor_layout(name, base[name], tensor)


def _check_tensor_layout(name: str, b: Any, tensor: Any) -> None:
    if b is None:
        raise LayoutMismatchError(f"tensor {name!r} is not in the base")
    if dtype_name(b) != dtype_name(tensor) or shape_of(b) != shape_of(tensor):
        raise LayoutMismatchError(
            f"tensor {name!r}: base is {dtype_name(b)}{list(shape_of(b))}, "
            f"new is {dtype_name(tensor)}{list(shape_of(tensor))}"
        )


class _OrderedPool:
    """Runs tasks on threads and yields results in submission order, ``limit`` in flight."""

    def __init__(self, threads: int, limit: int) -> None:
        self.executor = shared_pool(threads)
        self.limit = limit
        self.pending: deque[Future] = deque()

    def submit(self, fn, *args) -> Iterator[Any]:
        """Queue a task; yields the results that had to be drained to stay within the limit."""
        self.pending.append(self.executor.submit(fn, *args))
        while len(self.pending) > self.limit:
            yield self.pending.popleft().result()

    def drain(self) -> Iterator[Any]:
        while self.pending:
            yield self.pending.popleft().result()

    def close(self) -> None:
        # The pool is shared and stays: drop what has not started, wait for what has.
        for future in self.pending:
            future.cancel()
        wait(self.pending)


def _items(tensors: Tensors) -> Iterator[tuple[str, Any]]:
    return iter(tensors.items()) if isinstance(tensors, Mapping) else iter(tensors)


def _groups(
    new: Tensors,
    base: Mapping[str, Any] | None,
    chunk_elems: int,
    differ: Differ | None,
    base_words: Mapping[str, Any] | None = None,
):
    """Yield runs of tensors to code as one word space (see ``GroupHeader``), streaming:
    a group is yielded as soon as the next tensor cannot join it. With an iterator of
    named tensors, layout is checked tensor by tensor; a mismatch aborts the frame.
    ``base_words``: the base's host word views (``words_of``), made once by their holder,
    used for a tensor the numpy differ diffs (so the base is not re-viewed per version)."""
    group: list[Member] = []
    total = 0
    seen: set[str] = set()
    for name, tensor in _items(new):
        d = differ or default_differ(tensor)
        new_h = d.prepare(tensor)
        m = Member(name, dtype_name(tensor), shape_of(tensor), _numel(new_h), d, new_h, None)
        if name in seen:
            raise LayoutMismatchError(f"tensor {name!r} given twice")
        seen.add(name)
        if base is not None:
            b = base.get(name)
            if b is None or type(b) is not type(tensor) or b.dtype != tensor.dtype or b.shape != tensor.shape:
                _check_tensor_layout(name, b, tensor)
            held = base_words.get(name) if base_words is not None and isinstance(d, NumpyDiffer) else None
            m.base = held if held is not None else d.prepare(b)
        fits = (
            group
            and ITEMSIZE[group[0].dtype] == ITEMSIZE[m.dtype]
            and type(group[0].differ) is type(d)
            and total + m.numel <= chunk_elems
        )
        if group and not fits:
            yield group
            group, total = [], 0
        group.append(m)
        total += m.numel
    if group:
        yield group
    if base is not None and seen != set(base):
        raise LayoutMismatchError(f"new version lacks tensors of the base: {sorted(set(base) - seen)[:3]}")


def _encode(
    new: Tensors,
    base: Mapping[str, Any] | None,
    header: VersionHeader,
    config: CodecConfig,
    checksums_out: dict[str, str] | None,
    differ: Differ | None,
    update_base: bool = False,
    base_sums: Mapping[str, str] | None = None,
    base_words: Mapping[str, Any] | None = None,
) -> Iterator[bytes]:
    yield header.to_record()
    pool = _OrderedPool(config.threads, config.in_flight)
    v2 = config.coding == 2 and v2_available()
    group_bodies: list[bytes] = []  # G and S bodies, for the end record's manifest digest
    ntensors = 0

    frame_sums: list[GroupSums] = []  # a delta's, group by group: its S record's sums

    def emit(results: Iterator[Any]) -> Iterator[bytes]:
        for result in results:
            if isinstance(result, tuple):  # a delta chunk: its record and its sums' moves
                group_sums, rec, moves = result
                group_sums.add(moves)
            else:
                rec = result
            if rec[:1] == TAG_GROUP:
                group_bodies.append(rec[RECORD_HEADER.size : -RECORD_TRAILER.size])
            yield rec

    try:
        for members in _groups(new, base, config.chunk_elems, differ, base_words):
            ntensors += len(members)
            total = sum(m.numel for m in members)
            specs = chunk_specs(total, config.chunk_elems)
            # The group record goes through the ordered pool like a chunk, so hashing the
            # members overlaps with the diffs of this group's chunks and of its neighbours.
            if base is None:
                task = (anchor_group_record, members, config.chunk_elems, len(specs), checksums_out)
                yield from emit(pool.submit(*task))
                for spec in specs:
                    yield from emit(pool.submit(full_chunk, members, spec, config.zstd_level))
                continue
            sums = GroupSums([base_sums[m.name] for m in members], members)
            frame_sums.append(sums)
            # a delta's manifest carries no sums (zeros, which zstd codes in a few bytes):
            # the base's are in the version header's digest, the new ones follow in S
            unsummed = [EMPTY_SUM] * len(members)
            yield from emit(pool.submit(group_record, members, config.chunk_elems, len(specs), unsummed))
            for spec in specs:
                yield from emit(pool.submit(delta_chunk, sums, members, spec, config, v2, update_base))
        yield from emit(pool.drain())
        if base is not None:  # every chunk is out, so every move is in
            new_sums = {name: s for g in frame_sums for name, s in g.finish(checksums_out)}
            sums_record = record(TAG_SUMS, sums_body(new_sums))
            group_bodies.append(sums_record[RECORD_HEADER.size : -RECORD_TRAILER.size])
            yield sums_record
        yield EndRecord(ntensors, manifest_digest(group_bodies)).to_record()
    finally:
        pool.close()


def _numel(handle: Any) -> int:
    return int(handle.numel()) if callable(getattr(handle, "numel", None)) else int(handle.size)


def encode_anchor(
    new: Tensors,
    *,
    version: int,
    config: CodecConfig | None = None,
    checksums_out: dict[str, str] | None = None,
    differ: Differ | None = None,
) -> Iterator[bytes]:
    """Records of a full (compressed) anchor of ``new`` at ``version``."""
    config = config or CodecConfig()
    header = VersionHeader("anchor", version, None, codec=config.wire_params())
    return _encode(new, None, header, config, checksums_out, differ)


def encode_delta(
    base: Mapping[str, Any],
    new: Tensors,
    *,
    base_version: int,
    version: int,
    config: CodecConfig | None = None,
    base_checksums: Mapping[str, str] | None = None,
    checksums_out: dict[str, str] | None = None,
    differ: Differ | None = None,
    update_base: bool = False,
    base_words: Mapping[str, Any] | None = None,
) -> Iterator[bytes]:
    """Records of the delta ``base`` (at ``base_version``) → ``new`` (at ``version``).

    ``update_base``: each chunk, once coded, writes its changed words into ``base`` (the
    publisher's snapshot then holds ``new`` without a second copy of the state; a frame
    abandoned part way leaves ``base`` mixed, so its holder must send an anchor next).

    ``base_words``: the host word views of ``base``'s tensors (``words_of``), kept by a
    holder that encodes many deltas against the same buffers (the publisher), so they are
    not made again per version; they must view ``base``'s own memory.

    ``base_checksums`` (from the previous encode's ``checksums_out``) saves hashing the base,
    whose digest goes into the version header so a receiver refuses a delta for another base
    before touching anything.
    ``new`` is a mapping or an iterator of ``(name, tensor)`` pairs (as frameworks stream
    them). With a mapping, ``LayoutMismatchError`` is raised before anything is yielded;
    with an iterator, when the mismatching tensor arrives (the frame is then incomplete,
    and a receiver refuses it).
    """
    config = config or CodecConfig()
    if isinstance(new, Mapping):
        check_same_layout(base, new)
    if version == base_version:
        raise ValueError(f"a delta must move to a new version (both are {version})")
    if base_checksums is None or set(base_checksums) != set(base):
        base_checksums = _checksums(base, config, differ)
    header = VersionHeader(
        "delta",
        version,
        base_version,
        base_digest=state_digest(dict(base_checksums)),
        codec=config.wire_params(),
    )
    return _encode(new, base, header, config, checksums_out, differ, update_base, base_checksums, base_words)


def _checksums(state: Mapping[str, Any], config: CodecConfig, differ: Differ | None) -> dict[str, str]:
    def one(item):
        name, tensor = item
        d = differ or default_differ(tensor)
        return name, d.checksum(d.prepare(tensor))

    return dict(shared_pool(config.threads).map(one, state.items()))
