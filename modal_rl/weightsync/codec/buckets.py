"""A publisher's delta layout: every per-tensor decision made once per anchor.

``encode_delta`` (``encode``) meets each tensor of each version in Python: a word view, a
member record, a group record, a piece list per chunk, a sum in hex. At tens of thousands of
tensors (expert matrices, or every rank's dim-0 piece of every tensor) that is most of a
version's cost. A ``DeltaLayout`` is made from the publisher's snapshot when it takes an
anchor and holds, for the deltas that follow:

- the groups and chunks ``encode`` would form (same rule), each group's delta record (a
  delta's group record names no sums, so it is the same every version) and, per chunk, its
  pieces as int64 tables — base addresses (the snapshot's buffers, fixed until the next
  anchor), first word, count, chunk-local start — that the compiled pass walks (``fused``);
- the snapshot's sums as two lane arrays (``sum_lanes``), moved by each chunk's lanes and
  digested from one buffer.

A version then costs per tensor one name, dtype and shape check and one address, and per
chunk a few array operations. Frames are byte-identical to ``encode.encode_delta``'s for
the same snapshot, tensors and config (tested), so receivers see no difference.

Invariants: the layout belongs to one snapshot (its buffers' addresses are in the tables),
so the publisher drops it when an anchor replaces them; it is made only where every
snapshot tensor is contiguous host memory at an 8-byte aligned address and numba is there
(``build`` returns None otherwise, and the publisher keeps ``encode_delta``); a new tensor
that is not contiguous host memory at an aligned address is copied to one first (the copy
is kept alive until its chunks are coded).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from modal_rl.weightsync.codec import fused, sum_lanes
from modal_rl.weightsync.codec.codings.chunks import (
    ChunkSpec,
    encode_delta_chunk,
    pick_by_time,
)
from modal_rl.weightsync.codec.dtypes import dtype_name, is_torch, words_of
from modal_rl.weightsync.codec.encode import (
    CodecConfig,
    Tensors,
    _check_tensor_layout,
    _items,
    _OrderedPool,
    check_same_layout,
    chunk_specs,
    shape_of,
)
from modal_rl.weightsync.codec.encode_tasks import v2_available
from modal_rl.weightsync.codec.linsum import EMPTY as EMPTY_SUM
from modal_rl.weightsync.errors import LayoutMismatchError
from modal_rl.weightsync.wire.frames import (
    RECORD_HEADER,
    RECORD_TRAILER,
    TAG_CHUNK,
    TAG_GROUP,
    TAG_SUMS,
    EndRecord,
    GroupHeader,
    TensorHeader,
    VersionHeader,
    manifest_digest,
    record,
)


@dataclass
class _Chunk:
    spec: ChunkSpec
    members: np.ndarray  # global tensor index of each piece
    at_bytes: np.ndarray  # the piece's first byte in its tensor
    addr_b: np.ndarray
    counts: np.ndarray
    firsts: np.ndarray  # the piece's first 8-byte block in its tensor
    starts: np.ndarray  # chunk-local
    word: np.dtype
    base_parts: list[np.ndarray] | None  # 2-byte chunks: the snapshot's words, for v2


@dataclass
class _Group:
    lo: int  # its tensors are lo..hi-1 of the layout
    hi: int
    record: bytes
    chunks: list[_Chunk]


def _address(words: np.ndarray) -> int:
    return words.__array_interface__["data"][0]


class DeltaLayout:
    """See the module docstring. Made by ``build``; used by ``encode_delta``."""

    def __init__(self, snapshot: Mapping[str, Any], words: list[np.ndarray], chunk_elems: int) -> None:
        import torch

        self.tensor_type = torch.Tensor
        self.snapshot = snapshot
        self.chunk_elems = chunk_elems
        self.names = list(snapshot)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.dtypes = [snapshot[n].dtype for n in self.names]
        self.shapes = [shape_of(snapshot[n]) for n in self.names]
        self.dtype_names = [dtype_name(snapshot[n]) for n in self.names]
        self.words = words  # the snapshot's word views: the tables' addresses point into them
        self.raw_bytes = sum(w.nbytes for w in words)
        self.digest = sum_lanes.SortedDigest(self.names)
        self.groups = self._group(snapshot, words)
        self.lanes: tuple[np.ndarray, np.ndarray] | None = None
        self.sums: dict[str, str] | None = None  # the sums ``lanes`` hold, as last handed out
        self.sums_digest: str | None = None

    @classmethod
    def build(cls, snapshot: Mapping[str, Any], chunk_elems: int) -> DeltaLayout | None:
        """The layout of a host snapshot, or None where it does not qualify (see the module)."""
        if not snapshot or not fused.ready():
            return None
        words = []
        for tensor in snapshot.values():
            if is_torch(tensor) and tensor.device.type != "cpu":
                return None
            w = words_of(tensor)
            if not (w.flags.c_contiguous and w.flags.writeable) or _address(w) % 8:
                return None
            if is_torch(tensor) and w.size and tensor.data_ptr() != _address(w):
                return None  # a copy (a strided snapshot tensor): writes must reach the snapshot
            words.append(w)
        return cls(snapshot, words, chunk_elems)

    def _group(self, snapshot: Mapping[str, Any], words: list[np.ndarray]) -> list[_Group]:
        """``encode._groups``' rule: consecutive tensors of one word width share a group
        while their words fit one chunk."""
        groups, lo, total = [], 0, 0
        for i, w in enumerate(words):
            if i > lo and (w.itemsize != words[lo].itemsize or total + w.size > self.chunk_elems):
                groups.append(self._make_group(lo, i, total))
                lo, total = i, 0
            total += w.size
        if words:
            groups.append(self._make_group(lo, len(words), total))
        return groups

    def _make_group(self, lo: int, hi: int, total: int) -> _Group:
        tensors = tuple(
            TensorHeader(self.names[i], self.dtype_names[i], self.shapes[i], EMPTY_SUM) for i in range(lo, hi)
        )
        specs = chunk_specs(total, self.chunk_elems)
        rec = record(TAG_GROUP, GroupHeader(tensors, self.chunk_elems, len(specs)).body())
        item = self.words[lo].itemsize
        per = max(1, 8 // item)
        offsets = np.cumsum([0] + [self.words[i].size for i in range(lo, hi)])
        chunks = []
        for spec in specs:
            a_lo, a_hi = spec.elem_start, spec.elem_start + spec.elem_count
            rows = []
            for k in range(hi - lo):
                a, b = max(a_lo, int(offsets[k])), min(a_hi, int(offsets[k + 1]))
                if a < b:
                    rows.append((lo + k, a - int(offsets[k]), b - a, a - a_lo))
            members = np.array([r[0] for r in rows], np.int64)
            at = np.array([r[1] for r in rows], np.int64)
            base = np.array([_address(self.words[r[0]]) for r in rows], np.int64)
            parts = [self.words[i][s : s + n].view(np.uint16) for i, s, n, _ in rows] if item == 2 else None
            chunks.append(
                _Chunk(
                    spec,
                    members,
                    at * item,
                    base + at * item,
                    np.array([r[2] for r in rows], np.int64),
                    at // per,
                    np.array([r[3] for r in rows], np.int64),
                    self.words[lo].dtype,
                    parts,
                )
            )
        return _Group(lo, hi, rec, chunks)

    def _base_lanes(self, base_sums: Mapping[str, str]) -> tuple[np.ndarray, np.ndarray]:
        """The snapshot's sums as lanes: the ones this layout handed out last, when
        ``base_sums`` is that very dict, else parsed from it (once after an anchor)."""
        if self.lanes is None or base_sums is not self.sums:
            self.lanes = sum_lanes.from_hex([base_sums[n] for n in self.names])
            self.sums_digest = self.digest.digest(*self.lanes)
        return self.lanes

    def _address_of(self, i: int, name: str, tensor: Any, keep: list[Any]) -> int:
        """Tensor ``i``'s new words' address, after the layout check ``encode`` makes: a
        contiguous host tensor's own memory, else a contiguous aligned copy of its words."""
        if name != self.names[i]:
            what = "given out of the base's order" if name in self.index else "not in the base"
            raise LayoutMismatchError(f"tensor {name!r} is {what} (expected {self.names[i]!r} there)")
        if (
            isinstance(tensor, self.tensor_type)
            and tensor.dtype is self.dtypes[i]
            and tensor.shape == self.shapes[i]
            and tensor.is_cpu
            and tensor.is_contiguous()
        ):
            address = tensor.data_ptr()
            if address % 8 == 0:
                keep.append(tensor)
                return address
        _check_tensor_layout(name, self.snapshot[name], tensor)
        if is_torch(tensor) and tensor.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {tensor.device}: a host layout takes host tensors")
        w = words_of(tensor)
        if not w.flags.c_contiguous or _address(w) % 8:
            w = w.copy()
        keep.append(w)
        return _address(w)

    def encode_delta(
        self,
        new: Tensors,
        *,
        base_version: int,
        version: int,
        config: CodecConfig,
        base_checksums: Mapping[str, str],
        checksums_out: dict[str, str] | None = None,
        update_base: bool = False,
    ) -> Iterator[bytes]:
        """``encode.encode_delta(snapshot, new, ...)``, byte for byte, for the snapshot this
        layout was made from (``config.chunk_elems`` must be the layout's)."""
        if config.chunk_elems != self.chunk_elems:
            raise ValueError(
                f"layout made for chunks of {self.chunk_elems} words, config has {config.chunk_elems}"
            )
        if isinstance(new, Mapping) and list(new) != self.names:
            check_same_layout(self.snapshot, new)  # names its difference
        if version == base_version:
            raise ValueError(f"a delta must move to a new version (both are {version})")
        lanes = self._base_lanes(base_checksums)
        header = VersionHeader(
            "delta", version, base_version, base_digest=self.sums_digest, codec=config.wire_params()
        )
        return self._encode(new, header, config, lanes, checksums_out, update_base)

    def _encode(self, new, header, config, lanes, checksums_out, update_base) -> Iterator[bytes]:
        yield header.to_record()
        pool = _OrderedPool(config.threads, config.in_flight)
        # as ``encode_tasks.delta_chunk``: v2 only where a known link rate lets it pay
        v2 = config.coding == 2 and v2_available() and config.link_bytes_per_s is not None
        a, c = lanes[0].copy(), lanes[1].copy()
        bodies: list[bytes] = []
        addresses = np.zeros(len(self.names), np.int64)
        items = _items(new)

        def emit(results: Iterator[Any]) -> Iterator[bytes]:
            for rec, chunk, move_a, move_c in results:
                if chunk is None:
                    bodies.append(rec[RECORD_HEADER.size : -RECORD_TRAILER.size])
                else:
                    sum_lanes.add(a, c, chunk.members, move_a, move_c)
                yield rec

        try:
            for group in self.groups:
                keep: list[Any] = []  # the new tensors' memory, alive while their chunks run
                for i in range(group.lo, group.hi):
                    item = next(items, None)
                    if item is None:
                        missing = self.names[i : i + 3]
                        raise LayoutMismatchError(f"new version lacks tensors of the base: {missing}")
                    addresses[i] = self._address_of(i, item[0], item[1], keep)
                yield from emit(pool.submit(_done, group.record))
                for chunk in group.chunks:
                    task = (_delta_chunk, chunk, addresses[chunk.members] + chunk.at_bytes, keep, config, v2)
                    yield from emit(pool.submit(*task, update_base))
            extra = next(items, None)
            if extra is not None:
                raise LayoutMismatchError(f"tensor {extra[0]!r} is not in the base")
            yield from emit(pool.drain())
            sums = sum_lanes.to_hex(a, c)
            digest = self.digest.digest(a, c)
            sums_record = record(TAG_SUMS, bytes.fromhex(digest))
            bodies.append(sums_record[RECORD_HEADER.size : -RECORD_TRAILER.size])
            yield sums_record
            yield EndRecord(len(self.names), manifest_digest(bodies)).to_record()
        finally:
            pool.close()
        if checksums_out is not None:
            checksums_out.update(zip(self.names, sums, strict=True))
        if update_base:  # the snapshot now holds these sums: the next delta starts from them
            self.lanes, self.sums, self.sums_digest = (a, c), checksums_out, digest


def _done(rec: bytes):
    return rec, None, None, None


def _delta_chunk(chunk: _Chunk, addr_n: np.ndarray, keep, config: CodecConfig, v2: bool, update_base: bool):
    """``encode_tasks.delta_chunk`` for a laid-out chunk: (record, chunk, its pieces' sum
    moves as two lanes). ``keep`` holds the memory ``addr_n`` points into."""
    word, spec, level = chunk.word, chunk.spec, config.zstd_level
    two_byte = v2 and word.itemsize == 2  # v2 is set only with a known link rate
    base_table = (chunk.addr_b, addr_n, chunk.counts, chunk.firsts, chunk.starts)
    if not two_byte:
        pos, old, new, move_a, move_c = fused.diff_table(base_table, word, spec.elem_count, update_base)
        body = encode_delta_chunk(spec, pos, old, new, level, config.coding == 0)
        return record(TAG_CHUNK, body), chunk, move_a, move_c
    starts = chunk.starts.tolist()
    gathered = np.empty(spec.elem_count, word)
    fused.gather_table(addr_n, chunk.counts, chunk.starts, gathered)
    new_parts = np.split(gathered, starts[1:])
    pos, old, new, move_a, move_c = fused.diff_table(base_table, word, spec.elem_count, False)
    link, costs = config.link_bytes_per_s, config.receiver_costs
    body, _ = pick_by_time(spec, chunk.base_parts, new_parts, starts, pos, old, new, level, link, costs)
    if update_base and pos.size:
        fused.write_table(chunk.addr_b, chunk.counts, chunk.starts, pos, new)
    del keep
    return record(TAG_CHUNK, body), chunk, move_a, move_c
