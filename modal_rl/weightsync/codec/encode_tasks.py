"""The tasks an encode runs on its thread pool: group records, delta and anchor chunks.

Each task reads only its own chunk's words (and, with ``update_base``, writes only those of
the base), so chunks run in parallel; a delta chunk also reports how it moves its tensors'
ls128 sums (``linsum``), which the encoder adds up in frame order for the ``S`` record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from modal_rl.weightsync.codec.codings.chunks import (
    ChunkSpec,
    encode_delta_chunk,
    encode_delta_chunk_v2,
    encode_full_chunk,
    pick_by_time,
)
from modal_rl.weightsync.codec.differ import Differ, NumpyDiffer
from modal_rl.weightsync.codec.diffwords import join_diffs
from modal_rl.weightsync.codec.linsum import add_sums
from modal_rl.weightsync.wire.dtype_codes import ITEMSIZE
from modal_rl.weightsync.wire.frames import TAG_CHUNK, TAG_GROUP, GroupHeader, TensorHeader, record


@dataclass
class Member:
    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    differ: Differ
    new: Any
    base: Any | None


def anchor_group_record(members: list[Member], chunk_elems: int, nchunks: int, checksums_out) -> bytes:
    """An anchor's group record: every member summed in full."""
    sums = [m.differ.checksum(m.new) for m in members]
    if checksums_out is not None:
        checksums_out.update((m.name, s) for m, s in zip(members, sums, strict=True))
    return group_record(members, chunk_elems, nchunks, sums)


def group_record(members: list[Member], chunk_elems: int, nchunks: int, sums: list[str]) -> bytes:
    tensors = tuple(TensorHeader(m.name, m.dtype, m.shape, s) for m, s in zip(members, sums, strict=True))
    return record(TAG_GROUP, GroupHeader(tensors, chunk_elems, nchunks).body())


class GroupSums:
    """A delta group's sums: the base's, moved by every chunk's changed words (``linsum``);
    the frame's ``S`` record follows its last chunk. Moves are added in emission order, by
    the one thread that emits, so no lock is needed."""

    def __init__(self, base: list[str], members: list[Member]) -> None:
        self.base, self.members = base, members
        self.new = list(base)
        self._lanes: np.ndarray | None = None  # moves added as lanes (``add_lanes``), not yet in ``new``

    def add(self, moves) -> None:
        """A chunk's moves: (member index, hex move) pairs, or (member indices, lane a, lane c)
        from the fused pass (``add_lanes``)."""
        if isinstance(moves, tuple):
            self.add_lanes(*moves)
            return
        for i, move in moves:
            self.new[i] = add_sums(self.new[i], move)

    def add_lanes(self, members: list[int], a: np.ndarray, c: np.ndarray) -> None:
        """Moves as their two uint64 lanes (``fused``), one per listed member: kept as lanes
        and turned into hex once per member, at ``finish``."""
        if self._lanes is None:
            self._lanes = np.zeros((2, len(self.members)), np.uint64)
        with np.errstate(over="ignore"):
            self._lanes[0, members] += a
            self._lanes[1, members] += c

    def finish(self, checksums_out: dict[str, str] | None) -> list[tuple[str, str]]:
        """(name, new sum) of every member, also written into ``checksums_out``."""
        if self._lanes is not None:
            for i in np.flatnonzero(self._lanes[0] | self._lanes[1]).tolist():
                self.new[i] = add_sums(
                    self.new[i], f"{int(self._lanes[0, i]):016x}{int(self._lanes[1, i]):016x}"
                )
            self._lanes = None
        named = [(m.name, s) for m, s in zip(self.members, self.new, strict=True)]
        if checksums_out is not None:
            checksums_out.update(named)
        return named


def word_space(members: list[Member], attr: str) -> Any:
    """The group's word space: the tensor itself, or its members' words concatenated
    (several members only ever share one chunk, so this copy is bounded by chunk_elems)."""
    if len(members) == 1:
        return getattr(members[0], attr)
    return members[0].differ.concat([getattr(m, attr) for m in members])


def v2_available() -> bool:
    from modal_rl.weightsync.codec.codings import chunks_v2

    return chunks_v2.available()


def chunk_pieces(members: list[Member], spec: ChunkSpec) -> Iterator[tuple[int, Member, int, int, int]]:
    """The chunk's words member by member: (member index, member, first word in it, count, chunk-local
    start). A delta reads its members in place; no word space is concatenated."""
    lo, hi, offset = spec.elem_start, spec.elem_start + spec.elem_count, 0
    for i, m in enumerate(members):
        a, b = max(lo, offset), min(hi, offset + m.numel)
        if a < b:
            yield i, m, a - offset, b - a, a - lo
        offset += m.numel


def delta_chunk(
    sums: GroupSums,
    members: list[Member],
    spec: ChunkSpec,
    config: Any,  # encode.CodecConfig (not imported: encode imports this module)
    v2: bool,
    update_base: bool,
) -> tuple[GroupSums, bytes, Any]:
    """(``sums``, one delta chunk's record, how it moves its members' sums: (member index,
    move) pairs, or the fused pass's (member indices, lane a, lane c); ``GroupSums.add``
    takes either); with ``update_base``, the base's words of this chunk take the new ones once it is coded
    (only this task ever touches them)."""
    d, level = members[0].differ, config.zstd_level
    pieces = list(chunk_pieces(members, spec))
    starts = [start for *_, start in pieces]
    # v2 makes a pass over every word of the chunk on both sides, which pays only on a
    # link slow enough (``chunks_v2.v2_pays``): with the link rate unknown, v1 codes it
    by_time = v2 and ITEMSIZE[members[0].dtype] == 2 and config.link_bytes_per_s is not None
    if isinstance(d, NumpyDiffer):
        done = _fused_delta_chunk(sums, pieces, spec, config, by_time, update_base)
        if done is not None:
            return done
    if by_time:
        # v2 models every held word of the chunk, so it reads the whole chunk on the host
        # (a copy from the device for TorchDiffer), tensor by tensor
        base_parts = [d.read(m.base, at, n).view(np.uint16) for _, m, at, n, _ in pieces]
        new_parts = [d.read(m.new, at, n).view(np.uint16) for _, m, at, n, _ in pieces]
        body, positions, old = encode_delta_chunk_v2(
            spec, base_parts, new_parts, starts, level, config.link_bytes_per_s, config.receiver_costs
        )
        moves = chunk_moves(pieces, positions, old)
        if update_base:  # v2 read every word of the chunk anyway: one copy while it is hot
            for _, m, at, n, _ in pieces:
                d.copy(m.base, m.new, at, n)
        return sums, record(TAG_CHUNK, body), moves
    diffs = [d.diff_moved(m.base, m.new, at, n) for _, m, at, n, _ in pieces]
    if update_base:  # only the changed words are written
        for (_, m, at, _n, _), (pos, _old, new, _move) in zip(pieces, diffs, strict=True):
            d.write(m.base, at, pos, new)
    moves = [(i, move) for (i, *_), (pos, _old, _new, move) in zip(pieces, diffs, strict=True) if pos.size]
    diffs = [diff[:3] for diff in diffs]
    positions, old_words, new_words = join_diffs(diffs, starts)
    dense_xor = config.coding == 0
    body = encode_delta_chunk(spec, positions, old_words, new_words, level, dense_xor)
    return sums, record(TAG_CHUNK, body), moves


def _fused_delta_chunk(
    sums: GroupSums, pieces, spec: ChunkSpec, config: Any, by_time: bool, update_base: bool
):
    """``delta_chunk`` in one compiled pass over the chunk's host pieces (``fused``): compare,
    emit, write the changed blocks into the base, move the sums. Coded for time on a known
    link (``by_time``), the base is written after the coding is picked: v2 reads the old
    words. None where the pass does not apply (the caller's per-piece path runs)."""
    from modal_rl.weightsync.codec import fused

    write = update_base and not by_time
    host = [(m.base, m.new, at, n, start) for _, m, at, n, start in pieces]
    done = fused.diff_chunk(host, spec.elem_count, write)
    if done is None:
        return None
    positions, old, new, move_a, move_c = done
    moves = ([i for i, *_ in pieces], move_a, move_c)  # added by the one emitting thread
    level = config.zstd_level
    if not by_time:
        body = encode_delta_chunk(spec, positions, old, new, level, config.coding == 0)
        return sums, record(TAG_CHUNK, body), moves
    base_parts = [base[at : at + n].view(np.uint16) for base, _, at, n, _ in host]
    new_parts = [new_words[at : at + n].view(np.uint16) for _, new_words, at, n, _ in host]
    starts = [start for *_, start in pieces]
    link, costs = config.link_bytes_per_s, config.receiver_costs
    body, v2_picked = pick_by_time(
        spec, base_parts, new_parts, starts, positions, old, new, level, link, costs
    )
    if update_base and v2_picked:  # v2 read every word of the chunk: one copy while it is hot
        for base, new_words, at, n, _ in host:
            np.copyto(base[at : at + n], new_words[at : at + n])
    elif update_base and positions.size:
        fused.write_changed(host, positions, new)
    return sums, record(TAG_CHUNK, body), moves


def chunk_moves(pieces, positions: np.ndarray, old: np.ndarray) -> list[tuple[int, str]]:
    """Sum moves of a chunk's pieces from its chunk-local changes (sorted)."""
    cuts = np.searchsorted(positions, [start for *_, start in pieces] + [1 << 62])
    moves = []
    for k, (i, m, at, _n, start) in enumerate(pieces):
        a, b = cuts[k], cuts[k + 1]
        if a < b:
            moves.append((i, m.differ.delta_sum(m.new, positions[a:b] - start + at, old[a:b])))
    return moves


def full_chunk(members: list[Member], spec: ChunkSpec, level: int) -> bytes:
    words = members[0].differ.read(word_space(members, "new"), spec.elem_start, spec.elem_count)
    return record(TAG_CHUNK, encode_full_chunk(spec, words, level))
