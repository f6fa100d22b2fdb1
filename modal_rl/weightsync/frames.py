"""Frames: the self-describing, versioned byte stream that carries one policy version.

A frame is a sequence of records; every record is

    tag: 1 byte | body_len: u32 LE | body | xxh3_64(tag, body_len, body): u64 LE

so a flipped bit or a cut anywhere is caught at the record it hits, before the record's
contents are used. The records of one version, in order:

- ``V`` version header: ``b"MRLW"``, format version u16, then JSON (kind, version,
  base_version, codec parameters);
- per tensor, ``T`` tensor header (binary: dtype, shape, chunk_elems, nchunks, xxh3-128 of
  the new state, xxh3-128 of the base for deltas, name), followed by its
  ``nchunks`` ``C`` chunk records (see ``streams``);
- ``E`` end: JSON with the tensor count and the xxh3-128 of all ``T`` bodies in order, so a
  dropped, duplicated or reordered tensor is refused.

The full specification is ``docs/weight-sync-format.md``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

import xxhash

from modal_rl.weightsync.dtypes import DTYPE_BY_CODE, DTYPE_CODES
from modal_rl.weightsync.errors import CorruptFrameError, TruncatedFrameError

MAGIC = b"MRLW"
FORMAT_VERSION = 1
RECORD_HEADER = struct.Struct("<cI")
RECORD_TRAILER = struct.Struct("<Q")
MAX_RECORD_BYTES = 1 << 31
TAG_VERSION, TAG_TENSOR, TAG_CHUNK, TAG_END = b"V", b"T", b"C", b"E"


def record(tag: bytes, body: bytes | memoryview) -> bytes:
    header = RECORD_HEADER.pack(tag, len(body))
    h = xxhash.xxh3_64(header)
    h.update(body)
    return b"".join((header, body, RECORD_TRAILER.pack(h.intdigest())))


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True)
class VersionHeader:
    kind: str  # "anchor" | "delta"
    version: int
    base_version: int | None
    codec: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> bytes:
        return record(TAG_VERSION, MAGIC + struct.pack("<H", FORMAT_VERSION) + _json(asdict(self)))

    @classmethod
    def from_body(cls, body: bytes) -> VersionHeader:
        if body[:4] != MAGIC:
            raise CorruptFrameError("not a modal-rl weight-sync frame (bad magic)")
        (fmt,) = struct.unpack_from("<H", body, 4)
        if fmt != FORMAT_VERSION:
            raise CorruptFrameError(f"frame format version {fmt} is not supported (this reader: {FORMAT_VERSION})")
        data = _loads(body[6:], "version header")
        if data.get("kind") not in ("anchor", "delta"):
            raise CorruptFrameError(f"unknown frame kind {data.get('kind')!r}")
        if data["kind"] == "delta" and data.get("base_version") is None:
            raise CorruptFrameError("a delta frame must name its base version")
        return cls(**data)


# dtype code u8, flags u8, ndim u8, name length u16, chunk_elems u32, nchunks u32,
# checksum 16 bytes, base checksum 16 bytes; then ndim × u64 dims, then the UTF-8 name.
TENSOR_HEADER = struct.Struct("<BBBHII16s16s")
HAS_BASE_CHECKSUM = 1


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_elems: int
    nchunks: int
    checksum: str  # xxh3-128 hex of the new state's bytes
    base_checksum: str | None  # xxh3-128 hex of the base's bytes (deltas only)

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    def body(self) -> bytes:
        name = self.name.encode()
        flags = HAS_BASE_CHECKSUM if self.base_checksum is not None else 0
        fixed = TENSOR_HEADER.pack(
            DTYPE_CODES[self.dtype],
            flags,
            len(self.shape),
            len(name),
            self.chunk_elems,
            self.nchunks,
            bytes.fromhex(self.checksum),
            bytes.fromhex(self.base_checksum or "00" * 16),
        )
        return fixed + struct.pack(f"<{len(self.shape)}Q", *self.shape) + name

    @classmethod
    def from_body(cls, body: bytes) -> TensorHeader:
        if len(body) < TENSOR_HEADER.size:
            raise CorruptFrameError("tensor header too short")
        code, flags, ndim, name_len, chunk_elems, nchunks, checksum, base_checksum = TENSOR_HEADER.unpack_from(body)
        if len(body) != TENSOR_HEADER.size + 8 * ndim + name_len:
            raise CorruptFrameError("tensor header length does not match its fields")
        if code not in DTYPE_BY_CODE:
            raise CorruptFrameError(f"tensor header names unknown dtype code {code}")
        shape = struct.unpack_from(f"<{ndim}Q", body, TENSOR_HEADER.size)
        try:
            name = bytes(body[TENSOR_HEADER.size + 8 * ndim :]).decode()
        except UnicodeDecodeError as exc:
            raise CorruptFrameError("tensor name is not UTF-8") from exc
        header = cls(
            name=name,
            dtype=DTYPE_BY_CODE[code],
            shape=tuple(shape),
            chunk_elems=chunk_elems,
            nchunks=nchunks,
            checksum=checksum.hex(),
            base_checksum=base_checksum.hex() if flags & HAS_BASE_CHECKSUM else None,
        )
        expected = -(-header.numel // chunk_elems) if chunk_elems > 0 else -1
        if nchunks != expected:
            raise CorruptFrameError(f"tensor {name!r}: {nchunks} chunks for {header.numel} elements")
        return header


@dataclass(frozen=True)
class EndRecord:
    tensors: int
    manifest_digest: str

    def to_record(self) -> bytes:
        return record(TAG_END, _json(asdict(self)))


def manifest_digest(tensor_bodies: Iterable[bytes]) -> str:
    h = xxhash.xxh3_128()
    for body in tensor_bodies:
        h.update(struct.pack("<I", len(body)))
        h.update(body)
    return h.hexdigest()


def _loads(body: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFrameError(f"{what} is not valid JSON") from exc
    if not isinstance(data, dict):
        raise CorruptFrameError(f"{what} is not a JSON object")
    return data


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    chunks, remaining = [], n
    while remaining:
        data = stream.read(remaining)
        if not data:
            break
        chunks.append(data)
        remaining -= len(data)
    return b"".join(chunks)


def read_records(stream: BinaryIO) -> Iterator[tuple[bytes, bytes]]:
    """Yield ``(tag, body)`` for each record, verifying each record's checksum.

    Stops cleanly at end of stream between records; raises ``TruncatedFrameError`` when the
    stream ends inside a record and ``CorruptFrameError`` when a checksum fails.
    """
    while True:
        header = _read_exact(stream, RECORD_HEADER.size)
        if not header:
            return
        if len(header) < RECORD_HEADER.size:
            raise TruncatedFrameError("frame ends inside a record header")
        tag, length = RECORD_HEADER.unpack(header)
        if tag not in (TAG_VERSION, TAG_TENSOR, TAG_CHUNK, TAG_END) or length > MAX_RECORD_BYTES:
            raise CorruptFrameError(f"bad record header (tag {tag!r}, length {length})")
        body = _read_exact(stream, length)
        trailer = _read_exact(stream, RECORD_TRAILER.size)
        if len(body) < length or len(trailer) < RECORD_TRAILER.size:
            raise TruncatedFrameError(f"frame ends inside a {tag.decode()} record")
        (digest,) = RECORD_TRAILER.unpack(trailer)
        h = xxhash.xxh3_64(header)
        h.update(body)
        if h.intdigest() != digest:
            raise CorruptFrameError(f"checksum mismatch in a {tag.decode()} record")
        yield tag, body
