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
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from modal_rl.weightsync.differ import Differ, default_differ
from modal_rl.weightsync.dtypes import dtype_name
from modal_rl.weightsync.errors import LayoutMismatchError
from modal_rl.weightsync.frames import (
    RECORD_HEADER,
    RECORD_TRAILER,
    TAG_CHUNK,
    TAG_TENSOR,
    EndRecord,
    TensorHeader,
    VersionHeader,
    manifest_digest,
    record,
)
from modal_rl.weightsync.streams import MAX_CHUNK_ELEMS, ChunkSpec, encode_full_chunk, encode_xor_chunk


@dataclass(frozen=True)
class CodecConfig:
    """Codec parameters. ``threads`` encode/decode chunks in parallel; ``window`` bounds the
    chunks in flight (and so the extra memory) per encode or apply call."""

    chunk_elems: int = 1 << 22
    threads: int = min(8, os.cpu_count() or 1)
    zstd_level: int = 1
    window: int = 0  # 0 = 2 × threads

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_elems <= MAX_CHUNK_ELEMS:
            raise ValueError(f"chunk_elems must be in [1, {MAX_CHUNK_ELEMS}], got {self.chunk_elems}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not -7 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in [-7, 22], got {self.zstd_level}")

    @property
    def in_flight(self) -> int:
        return self.window or 2 * self.threads


def shape_of(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape)


def chunk_specs(numel: int, chunk_elems: int) -> list[ChunkSpec]:
    return [ChunkSpec(i, start, min(chunk_elems, numel - start)) for i, start in enumerate(range(0, numel, chunk_elems))]


def check_same_layout(base: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    if list(base) != list(new):
        missing, extra = sorted(set(new) - set(base)), sorted(set(base) - set(new))
        detail = f"only in new: {missing[:3]}, only in base: {extra[:3]}" if missing or extra else "order differs"
        raise LayoutMismatchError(f"base and new hold different tensors ({detail})")
    for name, tensor in new.items():
        b = base[name]
        if dtype_name(b) != dtype_name(tensor) or shape_of(b) != shape_of(tensor):
            raise LayoutMismatchError(
                f"tensor {name!r}: base is {dtype_name(b)}{list(shape_of(b))}, "
                f"new is {dtype_name(tensor)}{list(shape_of(tensor))}"
            )


class _OrderedPool:
    """Runs tasks on threads and yields results in submission order, ``limit`` in flight."""

    def __init__(self, threads: int, limit: int) -> None:
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weightsync")
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
        for future in self.pending:
            future.cancel()
        self.executor.shutdown(wait=True)


def _encode(
    new: Mapping[str, Any],
    base: Mapping[str, Any] | None,
    header: VersionHeader,
    config: CodecConfig,
    base_checksums: Mapping[str, str] | None,
    checksums_out: dict[str, str] | None,
    differ: Differ | None,
) -> Iterator[bytes]:
    yield header.to_record()
    pool = _OrderedPool(config.threads, config.in_flight)
    tensor_bodies: list[bytes] = []

    def emit(records: Iterator[bytes]) -> Iterator[bytes]:
        for rec in records:
            if rec[:1] == TAG_TENSOR:
                tensor_bodies.append(rec[RECORD_HEADER.size : -RECORD_TRAILER.size])
            yield rec

    try:
        for name, tensor in new.items():
            d = differ or default_differ(tensor)
            new_h = d.prepare(tensor)
            base_h = d.prepare(base[name]) if base is not None else None
            meta = (name, dtype_name(tensor), shape_of(tensor))
            specs = chunk_specs(_numel(new_h), config.chunk_elems)
            # The tensor record goes through the ordered pool like a chunk: its hashing
            # overlaps with the diffs of its own chunks and of the tensors around it.
            known_base_sum = (base_checksums or {}).get(name)
            yield from emit(
                pool.submit(_tensor_task, d, new_h, base_h, meta, config, len(specs), known_base_sum, checksums_out)
            )
            for spec in specs:
                if base_h is None:
                    yield from emit(pool.submit(_full_chunk, d, new_h, spec, config.zstd_level))
                else:
                    yield from emit(pool.submit(_delta_chunk, d, base_h, new_h, spec, config.zstd_level))
        yield from emit(pool.drain())
        yield EndRecord(len(tensor_bodies), manifest_digest(tensor_bodies)).to_record()
    finally:
        pool.close()


def _numel(handle: Any) -> int:
    return int(handle.numel()) if callable(getattr(handle, "numel", None)) else int(handle.size)


def _tensor_task(d, new_h, base_h, meta, config, nchunks, known_base_sum, checksums_out) -> bytes:
    name, dtype, shape = meta
    new_sum = d.checksum(new_h)
    base_sum = None if base_h is None else known_base_sum or d.checksum(base_h)
    if checksums_out is not None:
        checksums_out[name] = new_sum
    th = TensorHeader(name, dtype, shape, config.chunk_elems, nchunks, new_sum, base_sum)
    return record(TAG_TENSOR, th.body())


def _delta_chunk(d: Differ, base_h: Any, new_h: Any, spec: ChunkSpec, level: int) -> bytes:
    positions, xor_words = d.diff(base_h, new_h, spec.elem_start, spec.elem_count)
    return record(TAG_CHUNK, encode_xor_chunk(spec, positions, xor_words, level))


def _full_chunk(d: Differ, new_h: Any, spec: ChunkSpec, level: int) -> bytes:
    return record(TAG_CHUNK, encode_full_chunk(spec, d.read(new_h, spec.elem_start, spec.elem_count), level))


def encode_anchor(
    new: Mapping[str, Any],
    *,
    version: int,
    config: CodecConfig | None = None,
    checksums_out: dict[str, str] | None = None,
    differ: Differ | None = None,
) -> Iterator[bytes]:
    """Records of a full (compressed) anchor of ``new`` at ``version``."""
    config = config or CodecConfig()
    header = VersionHeader("anchor", version, None, codec=asdict(config) | {"window": config.in_flight})
    return _encode(new, None, header, config, None, checksums_out, differ)


def encode_delta(
    base: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    base_version: int,
    version: int,
    config: CodecConfig | None = None,
    base_checksums: Mapping[str, str] | None = None,
    checksums_out: dict[str, str] | None = None,
    differ: Differ | None = None,
) -> Iterator[bytes]:
    """Records of the delta ``base`` (at ``base_version``) → ``new`` (at ``version``).

    ``base_checksums`` (from the previous encode's ``checksums_out``) saves hashing the base.
    Raises ``LayoutMismatchError`` before yielding anything if the layouts differ.
    """
    config = config or CodecConfig()
    check_same_layout(base, new)
    if version == base_version:
        raise ValueError(f"a delta must move to a new version (both are {version})")
    header = VersionHeader("delta", version, base_version, codec=asdict(config) | {"window": config.in_flight})
    return _encode(new, base, header, config, base_checksums, checksums_out, differ)
