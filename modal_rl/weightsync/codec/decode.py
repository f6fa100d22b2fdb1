"""Apply a frame to a held state: deltas in place, anchors into fresh tensors.

Invariant (the one that matters to a rollout engine): ``apply_frame`` either returns with
every tensor at the frame's new version, each verified against the sender's ls128 sum
(``linsum``), or raises a ``WeightSyncError`` with the held state bit-identical to what it
was before. An anchor's tensors are summed in full; a delta's sums follow the change: the
held sums (checked against the version header's base digest) moved by each applied chunk's
changed words, whose digest must equal the frame's ``S`` record. Deltas get there by
rollback: every applied chunk is undone exactly (XOR again, or subtract what was added).
An anchor builds the tensors the caller swaps in: a held tensor of the same name, dtype and
shape is written in place with an undo log (``anchor_inplace``), rolled back like a delta.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, BinaryIO

import numpy as np

from modal_rl.weightsync.codec import anchor_inplace, fused, sum_lanes
from modal_rl.weightsync.codec.chunk_sums import chunk_moves, held_sums
from modal_rl.weightsync.codec.codings.chunks import (
    CTX_SPARSE,
    FULL,
    SUB_SPARSE,
    XOR_SPARSE,
    DecodedChunk,
    decode_chunk,
)
from modal_rl.weightsync.codec.codings.chunks_v2 import base_words
from modal_rl.weightsync.codec.differ import TorchDiffer, sum_of
from modal_rl.weightsync.codec.dtypes import dtype_name, empty_like_spec, is_torch, words_of
from modal_rl.weightsync.codec.encode import CodecConfig, shape_of
from modal_rl.weightsync.codec.held_layout import HeldGroup, HeldLayout
from modal_rl.weightsync.codec.linsum import EMPTY as EMPTY_SUM
from modal_rl.weightsync.codec.linsum import SUM_BLOCK_WORDS, add_sums
from modal_rl.weightsync.codec.workers import shared_pool
from modal_rl.weightsync.errors import (
    BaseMismatchError,
    ChecksumMismatchError,
    CorruptFrameError,
    LayoutMismatchError,
    TruncatedFrameError,
    WeightSyncError,
)
from modal_rl.weightsync.wire.auth import FROM_ENV, frame_keys
from modal_rl.weightsync.wire.dtype_codes import ITEMSIZE
from modal_rl.weightsync.wire.frames import (
    TAG_CHUNK,
    TAG_END,
    TAG_GROUP,
    TAG_SUMS,
    TAG_VERSION,
    EndRecord,
    GroupHeader,
    TensorHeader,
    VersionHeader,
    _loads,
    manifest_digest,
    read_records,
    read_sums_digest,
    state_digest,
    verify_records,
)


@dataclass
class ApplyResult:
    """What a successful apply produced. For anchors, ``state`` holds the new tensors."""

    header: VersionHeader
    checksums: dict[str, str]
    state: dict[str, Any] | None = None
    changed_words: int = 0
    total_words: int = 0
    verify_s: float = 0.0  # time spent hashing rebuilt tensors, summed over threads
    tensors: list[TensorHeader] = field(default_factory=list)


class _GroupJob:
    """One group's in-flight chunk applies and its verification. A delta group's ``moves`` add
    up its chunks' moves of the sums; ``new_sums``: its tensors' once every chunk is applied."""

    def __init__(
        self, header: GroupHeader, segments: list[tuple[int, Any]], total: int | None = None
    ) -> None:
        self.header = header
        self.segments = segments
        self.itemsize = ITEMSIZE[header.tensors[0].dtype]
        self.chunk_futures: list[Future] = []
        self.seen_chunks = 0
        self.moves = [EMPTY_SUM] * len(header.tensors)
        self.base_sums: list[str] = []  # a delta's: the held tensors' sums before it
        self.new_sums: list[str] = []
        self.in_place: list[bool] = []  # an anchor's: which members are held tensors (``anchor_inplace``)
        self.total = header.total if total is None else total
        # with a ``HeldLayout``: the segments' tables, and a delta's sums as lanes (``sum_lanes``)
        self.table: Any = None
        self.names: list[str] = []
        self.lanes: tuple[np.ndarray, np.ndarray] | None = None  # moves
        self.base_lanes: tuple[np.ndarray, np.ndarray] | None = None
        self.new_lanes: tuple[np.ndarray, np.ndarray] | None = None


def _words(tensor: Any) -> Any:
    """Host tensors as shared numpy words; device tensors as torch integer views, so a
    delta is scattered on the device and only its sparse contents cross from the host."""
    if is_torch(tensor) and tensor.device.type != "cpu":
        return TorchDiffer().prepare(tensor)
    return words_of(tensor)


def read_version_header(records: Iterator[tuple[bytes, bytes]]) -> VersionHeader:
    try:
        tag, body = next(records)
    except StopIteration:
        raise TruncatedFrameError("empty frame") from None
    if tag != TAG_VERSION:
        raise CorruptFrameError("frame does not start with a version header")
    return VersionHeader.from_body(body)


class _Applier:
    def __init__(self, config: CodecConfig) -> None:
        self.pool = shared_pool(config.threads)
        self.limit = config.in_flight
        self.applied: list[tuple[_GroupJob, bytes | DecodedChunk]] = []  # for rollback
        self.lock = threading.Lock()
        self.in_flight: list[Future] = []
        self.tasks: list[Future] = []  # everything this apply queued; close() waits for it
        self.closed = False
        self.changed = 0
        self.verify_s = 0.0

    def _submit(self, fn, *args) -> Future:
        with self.lock:
            if self.closed:
                raise RuntimeError("the apply ended (the frame was refused)")
            future = self.pool.submit(fn, *args)
            self.tasks.append(future)
        return future

    def submit_chunk(self, job: _GroupJob, body: bytes, is_anchor: bool) -> None:
        self.in_flight = [f for f in self.in_flight if not f.done()]
        if len(self.in_flight) >= self.limit:
            wait(self.in_flight[: len(self.in_flight) - self.limit + 1])
        future = self._submit(self._apply_chunk, job, body, job.seen_chunks, is_anchor)
        job.seen_chunks += 1
        job.chunk_futures.append(future)
        self.in_flight.append(future)

    def _apply_chunk(self, job: _GroupJob, body: bytes, expected_index: int, is_anchor: bool) -> None:
        gh = job.header
        where = f"group of {gh.tensors[0].name!r}"

        def base_for(index: int, count: int):
            # v2 chunks model the held words and decode into them: every check that could
            # refuse the chunk comes before
            if index != expected_index or count != min(gh.chunk_elems, job.total - index * gh.chunk_elems):
                raise CorruptFrameError(f"{where}: chunk {index} is not chunk {expected_index} of its group")
            if is_anchor:
                raise CorruptFrameError(f"{where}: chunk encoding does not fit the frame kind")
            lo = index * gh.chunk_elems
            return base_words(job.segments, lo, lo + count)

        chunk = decode_chunk(body, job.itemsize, gh.chunk_elems, base_for)
        try:
            if chunk.index != expected_index:
                raise CorruptFrameError(f"{where}: chunk {chunk.index} arrived as chunk {expected_index}")
            if chunk.elem_count != min(gh.chunk_elems, job.total - chunk.elem_start):
                raise CorruptFrameError(f"{where}: chunk {chunk.index} has the wrong size")
            if is_anchor != (chunk.encoding == FULL):
                raise CorruptFrameError(f"{where}: chunk encoding does not fit the frame kind")
            moves = lane_moves = None
            if is_anchor and any(job.in_place):  # the held words, with an undo log
                anchor_inplace.apply_full_chunk(job.segments, job.in_place, chunk, partial(self._log, job))
                moves = []
            elif chunk.encoding in (XOR_SPARSE, SUB_SPARSE):  # applied and summed in one pass
                xor = chunk.encoding == XOR_SPARSE
                if job.table is not None:
                    lane_moves = fused.apply_table(
                        job.table, chunk.elem_start, chunk.positions, chunk.values, xor
                    )
                if lane_moves is None:
                    moves = fused.apply_sparse(
                        job.segments, chunk.elem_start, chunk.positions, chunk.values, xor
                    )
            if moves is None and lane_moves is None:
                chunk.apply(job.segments)
        except BaseException:
            if chunk.host_written:  # the host words it already holds go back
                chunk.apply([(s, w) for s, w in job.segments if isinstance(w, np.ndarray)], undo=True)
            raise
        if moves is None and lane_moves is None:
            moves = [] if is_anchor else chunk_moves(chunk, job.segments)
        with self.lock:
            self.changed += chunk.nchanged
            if lane_moves is not None:
                k0, move_a, move_c = lane_moves
                job.lanes[0][k0 : k0 + move_a.size] += move_a
                job.lanes[1][k0 : k0 + move_a.size] += move_c
            elif job.lanes is not None:
                for i, move in moves:
                    sum_lanes.add(*job.lanes, np.array([i]), *sum_lanes.from_hex([move]))
            else:
                for i, move in moves:
                    job.moves[i] = add_sums(job.moves[i], move)
            if not is_anchor:
                # v2 chunks decode only against the words they replaced: keep them decoded
                self.applied.append((job, chunk if chunk.encoding == CTX_SPARSE else body))

    def _log(self, job: _GroupJob, undo: bytes) -> None:
        with self.lock:
            self.applied.append((job, undo))

    def verify(self, job: _GroupJob) -> Future:
        """The group's checksums, hashed once its chunks are applied. The hashing is only
        queued when the last chunk is done: a queued task that waited for chunks would hold
        a pool thread idle while the others decode (with two threads, no parallelism)."""
        result: Future = Future()
        pending = [len(job.chunk_futures)]

        def start_hashing(_: Future | None = None) -> None:
            if job.chunk_futures:
                with self.lock:
                    pending[0] -= 1
                    if pending[0]:
                        return
                failed = next((f.exception() for f in job.chunk_futures if f.exception() is not None), None)
                if failed is not None:
                    result.set_exception(failed)
                    return
            try:
                self._submit(self._hash_group, job).add_done_callback(lambda f: _copy_outcome(f, result))
            except RuntimeError as exc:  # the frame was refused meanwhile
                result.set_exception(exc)

        if not job.chunk_futures:
            start_hashing()
        for future in job.chunk_futures:
            future.add_done_callback(start_hashing)
        return result

    def _hash_group(self, job: _GroupJob) -> None:
        gh = job.header
        t0 = time.perf_counter()
        if job.seen_chunks != gh.nchunks:
            raise TruncatedFrameError(
                f"group of {gh.tensors[0].name!r}: {job.seen_chunks} of {gh.nchunks} chunks"
            )
        if job.lanes is not None:  # the same, as lanes
            job.new_lanes = (job.base_lanes[0] + job.lanes[0], job.base_lanes[1] + job.lanes[1])
        elif job.base_sums:  # a delta's group: the held sums moved by the changes, checked at the end
            job.new_sums = [add_sums(b, m) for b, m in zip(job.base_sums, job.moves, strict=True)]
        else:  # an anchor's: every tensor summed in full
            for th, (_, words) in zip(gh.tensors, job.segments, strict=True):
                actual = sum_of(words)
                if actual != th.checksum:
                    raise ChecksumMismatchError(
                        f"tensor {th.name!r}: rebuilt checksum {actual[:12]}… != sent {th.checksum[:12]}…"
                    )
        with self.lock:
            self.verify_s += time.perf_counter() - t0

    def rollback(self) -> None:
        # Wait for every chunk still running, then undo all applied XOR chunks.
        wait(self.in_flight)
        for job, done in self.applied:
            if not isinstance(done, DecodedChunk):
                done = decode_chunk(done, job.itemsize, job.header.chunk_elems)
            done.apply(job.segments, undo=True)
        self.applied.clear()

    def close(self) -> None:
        # The pool is shared and stays: wait for this apply's own tasks, and queue no more.
        with self.lock:
            self.closed = True
            tasks = list(self.tasks)
        for future in tasks:
            future.cancel()
        wait(tasks)


def apply_frame(
    state: MutableMapping[str, Any],
    stream: BinaryIO | Iterator[tuple[bytes, bytes]],
    *,
    held_version: int | None,
    held_checksums: dict[str, str] | None = None,
    config: CodecConfig | None = None,
    key=FROM_ENV,
    check_header: Callable[[VersionHeader], None] | None = None,
    layout: HeldLayout | None = None,
) -> ApplyResult:
    """Apply one frame read from ``stream``: a binary stream, or the frame's raw
    ``(tag, record)`` pairs as a transport receives them — then chunks are decoded while
    later records are still on the wire. ``check_header`` may refuse the frame by its
    (verified) version header before anything is decoded.

    A delta is applied in place onto ``state`` (which must be at ``held_version``); an
    anchor is decoded into new tensors returned in ``ApplyResult.state`` and ``state`` is
    not touched. ``held_checksums`` (name → ls128 of the held tensors, as the chain keeps
    them) lets a delta made from other weights be refused up front and verified from its
    changes alone; without them the held tensors are summed in full first. ``key``: the
    run key the frame must be signed with (default: ``MODAL_RL_RUN_KEY``), or ``None`` for
    an unsigned frame; every record is verified before it is used. ``layout``: a
    ``HeldLayout`` the caller keeps from delta to delta (the per-tensor work is then done
    once per layout, not per version; results are the same with or without it).
    """
    config = config or CodecConfig()
    keys = frame_keys(key)
    records = (
        read_records(stream, keys=keys) if hasattr(stream, "read") else verify_records(stream, keys=keys)
    )
    header = read_version_header(records)
    if check_header is not None:
        check_header(header)
    is_anchor = header.kind == "anchor"
    if not is_anchor and header.base_version != held_version:
        raise BaseMismatchError(
            f"delta {header.base_version}→{header.version} does not apply to held version {held_version}"
        )
    if not is_anchor and (held_checksums is None or set(held_checksums) != set(state)):
        held_checksums = held_sums(state)  # a full pass, only for a caller that kept no sums
    if is_anchor and layout is not None:
        layout.forget()  # the held tensors are about to be replaced
    held_lanes = layout.held_lanes(held_checksums) if layout is not None and not is_anchor else None
    held_digest = layout.sums_digest if held_lanes is not None else None
    if not is_anchor and header.base_digest != (held_digest or state_digest(held_checksums)):
        raise BaseMismatchError(
            f"delta {header.base_version}→{header.version} was made from other weights than the held ones"
        )
    target: dict[str, Any] = {} if is_anchor else state  # type: ignore[assignment]
    applier = _Applier(config)
    result = ApplyResult(header=header, checksums={})
    try:
        _apply_records(records, header, state, target, applier, result, held_checksums, (layout, held_lanes))
    except BaseException:
        applier.rollback()  # a delta's chunks, or an in-place anchor's undo log
        if layout is not None:
            layout.lanes = None
        raise
    finally:
        applier.close()
    result.changed_words = applier.changed
    result.verify_s = applier.verify_s
    if is_anchor:
        result.state = target
    return result


def _apply_records(records, header, state, target, applier, result, base_sums, held=(None, None)) -> None:
    is_anchor = header.kind == "anchor"
    layout, held_lanes = held if not is_anchor else (None, None)
    at = 0  # a delta's tensors so far; ``held_lanes`` line up while every group was cached
    job: _GroupJob | None = None
    verifications: list[Future] = []
    bodies: list[bytes] = []
    jobs: list[_GroupJob] = []  # a delta's, verified when its S record arrives
    sent_digest: str | None = None  # the S record's
    for tag, body in records:
        if tag in (TAG_GROUP, TAG_END) and job is not None and is_anchor:
            verifications.append(applier.verify(job))
        if tag in (TAG_GROUP, TAG_CHUNK) and sent_digest is not None:
            raise CorruptFrameError("a record after the delta's sums record other than its end")
        if tag == TAG_GROUP and layout is not None and (cached := layout.group(len(jobs), body, state)):
            job = _cached_group(cached, body, bodies, result)
            job.lanes = (np.zeros(len(cached.names), np.uint64), np.zeros(len(cached.names), np.uint64))
            n = len(cached.names)
            if held_lanes is not None and at + n <= held_lanes[0].size:
                job.base_lanes = (held_lanes[0][at : at + n], held_lanes[1][at : at + n])
            else:
                job.base_lanes = sum_lanes.from_hex([base_sums[name] for name in cached.names])
            at += n
            jobs.append(job)
        elif tag == TAG_GROUP:
            held_lanes = None  # this group is new: the held lanes no longer line up
            gh = GroupHeader.from_body(body)
            if not is_anchor and gh.chunk_elems % SUM_BLOCK_WORDS:
                raise CorruptFrameError(f"delta chunks of {gh.chunk_elems} words split checksum blocks")
            bodies.append(body)
            segments, offset, in_place = [], 0, []
            for th in gh.tensors:
                _check_tensor(th, state, is_anchor, result)
                if is_anchor:
                    held = anchor_inplace.held_target(state.get(th.name), th.dtype, th.shape)
                    target[th.name] = empty_like_spec(th.dtype, th.shape) if held is None else held
                    in_place.append(held is not None)
                segments.append((offset, _words(target[th.name])))
                offset += th.numel
                result.tensors.append(th)
                result.checksums[th.name] = th.checksum
            result.total_words += offset
            job = _GroupJob(gh, segments)
            job.in_place = in_place
            if not is_anchor:
                job.base_sums = [base_sums[th.name] for th in gh.tensors]
                jobs.append(job)
            if layout is not None:  # remembered for the next delta
                kept = layout.remember(len(jobs) - 1, body, gh, state, segments)
                job.table, job.names = kept.table, kept.names
                job.lanes = (np.zeros(len(kept.names), np.uint64), np.zeros(len(kept.names), np.uint64))
                job.base_lanes = sum_lanes.from_hex(job.base_sums)
                at += len(kept.names)
        elif tag == TAG_CHUNK:
            if job is None:
                raise CorruptFrameError("chunk record before any group header")
            if job.seen_chunks >= job.header.nchunks:
                raise CorruptFrameError(f"group of {job.header.tensors[0].name!r}: more chunks than declared")
            applier.submit_chunk(job, body, is_anchor)
        elif tag == TAG_SUMS:
            if is_anchor or not jobs or sent_digest is not None:
                raise CorruptFrameError("a sums record out of place (one, after a delta's last chunk)")
            sent_digest = read_sums_digest(body)
            bodies.append(body)
            verifications += [applier.verify(done) for done in jobs]
        elif tag == TAG_END:
            if jobs and sent_digest is None:
                raise CorruptFrameError("the delta ends without its sums record")
            _check_end(body, bodies, result, state, is_anchor)
            _raise_first(verifications)
            if jobs:
                _check_moved_sums(jobs, sent_digest, result, layout)
            return
        else:
            raise CorruptFrameError("a second version header inside one frame")
    raise TruncatedFrameError(f"frame for version {header.version} ends before its end record")


def _check_tensor(th: TensorHeader, state, is_anchor: bool, result: ApplyResult) -> None:
    if th.name in result.checksums:
        raise CorruptFrameError(f"tensor {th.name!r} appears twice in one frame")
    if is_anchor:
        return
    if th.name not in state:
        raise LayoutMismatchError(f"delta names tensor {th.name!r}, which the held state does not have")
    held = state[th.name]
    if dtype_name(held) != th.dtype or shape_of(held) != th.shape:
        raise LayoutMismatchError(
            f"tensor {th.name!r}: delta is {th.dtype}{list(th.shape)}, held is {dtype_name(held)}{list(shape_of(held))}"
        )


def _cached_group(cached: HeldGroup, body: bytes, bodies: list[bytes], result: ApplyResult) -> _GroupJob:
    """A delta group whose layout ``HeldLayout`` checked and kept: its job, no Python per tensor."""
    if not result.checksums.keys().isdisjoint(cached.empty_sums):
        twice = sorted(result.checksums.keys() & cached.empty_sums.keys())[0]
        raise CorruptFrameError(f"tensor {twice!r} appears twice in one frame")
    bodies.append(body)
    result.checksums.update(cached.empty_sums)
    result.tensors.extend(cached.header.tensors)
    job = _GroupJob(cached.header, cached.segments, cached.total)
    job.table, job.names = cached.table, cached.names
    result.total_words += cached.total
    return job


def _check_moved_sums(
    jobs: list[_GroupJob], sent_digest: str, result: ApplyResult, layout: HeldLayout | None = None
) -> None:
    """Every tensor's held sum moved by its chunks must digest to what the sender moved."""
    if all(job.new_lanes is not None for job in jobs):
        names = [name for job in jobs for name in job.names]
        a = np.concatenate([job.new_lanes[0] for job in jobs])
        c = np.concatenate([job.new_lanes[1] for job in jobs])
        moved, digest = layout.finish(names, a, c)
        if digest != sent_digest:
            raise ChecksumMismatchError(
                "the rebuilt tensors' sums differ from the sender's (a held word differed from the base)"
            )
        result.checksums.update(moved)
        layout.keep(a, c, moved, digest)
        return
    moved = {th.name: s for job in jobs for th, s in zip(job.header.tensors, job.new_sums, strict=True)}
    if state_digest(moved) != sent_digest:
        raise ChecksumMismatchError(
            "the rebuilt tensors' sums differ from the sender's (a held word differed from the base)"
        )
    result.checksums.update(moved)


def _check_end(body: bytes, bodies: list[bytes], result: ApplyResult, state, is_anchor: bool) -> None:
    end = EndRecord(**_loads(body, "end record"))
    if end.tensors != len(result.tensors) or end.manifest_digest != manifest_digest(bodies):
        raise CorruptFrameError("end record does not match the groups received (dropped or reordered groups)")
    if not is_anchor and set(result.checksums) != set(state):
        missing = sorted(set(state) - set(result.checksums))[:3]
        raise LayoutMismatchError(f"delta does not cover every held tensor (missing {missing})")


def _copy_outcome(source: Future, target: Future) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(None)


def _raise_first(futures: list[Future]) -> None:
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error if isinstance(error, WeightSyncError) else CorruptFrameError(str(error))
