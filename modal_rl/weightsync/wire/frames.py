"""Frames: the self-describing, versioned byte stream that carries one policy version.

A frame is a sequence of records; every record is

    tag: 1 byte | body_len: u32 LE | body | xxh3_64(tag, body_len, body): u64 LE

so a flipped bit or a cut anywhere is caught at the record it hits, before the record's
contents are used. A frame signed with the run's key (``auth``) has lower-case tags and a
32-byte MAC after the digest of every record; a reader given the key accepts only signed
frames, a keyless reader only unsigned ones. The records of one version, in order:

- ``V`` version header: ``b"MRLW"``, format version u16 (2), then JSON (kind, version,
  base_version, digest of the base's tensor checksums, codec parameters, and the publishing
  ``run`` and ``epoch``: see ``epoch``; signed like every record, so they cannot be altered);
- per group of tensors, a ``G`` group header (the manifest of its tensors: name, dtype,
  shape and a checksum -- ``codec.linsum``'s ls128 of the new state in an anchor, of the
  base in a delta; chunking), followed by its ``nchunks`` ``C`` chunk records (see
  ``streams``) over the group's concatenated words;
- in a delta, one ``S`` record after the last chunk: the ``state_digest`` of every tensor's
  ls128 at the new version, which the sender moved from the base's by the changed words
  alone (so it can only follow the chunks);
- ``E`` end: JSON with the tensor count and the xxh3-128 of all ``G`` bodies and the ``S``
  body in order, so a dropped, duplicated or reordered group is refused.

The full specification is ``docs/weight-sync-format.md``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, BinaryIO

import xxhash

from modal_rl import wire_json
from modal_rl.weightsync.errors import CorruptFrameError, TruncatedFrameError
from modal_rl.weightsync.wire.auth import FrameKeys, Verifier, trailer_size
from modal_rl.weightsync.wire.dtype_codes import DTYPE_BY_CODE, DTYPE_CODES, ITEMSIZE

MAGIC = b"MRLW"
FORMAT_VERSION = 3
# Format 1 had no run or epoch: its frames cannot be ordered across trainer restarts; format
# 2 checked tensors by an xxh3-128 of every word. A reader refuses both by name (re-encode
# or re-publish them).
FORMAT_HISTORY = {
    1: "before frames named their run and epoch",
    2: "before checksums followed the change (ls128, S records)",
}
MAX_EPOCH = (1 << 64) - 1
RECORD_HEADER = struct.Struct("<cI")
RECORD_TRAILER = struct.Struct("<Q")
MAX_RECORD_BYTES = 1 << 31
TAG_VERSION, TAG_GROUP, TAG_CHUNK, TAG_SUMS, TAG_END = b"V", b"G", b"C", b"S", b"E"
ALL_TAGS = (b"V", b"G", b"C", b"S", b"E", b"v", b"g", b"c", b"s", b"e")
SUM_BYTES = 16  # one ls128, and the digest of many


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
    base_digest: str | None = None  # deltas: state_digest() of the base's tensor checksums
    codec: dict[str, Any] = field(default_factory=dict)
    run: str = ""  # the publishing run (``auth.FrameKeys.run_id``); "" = unstamped codec output
    epoch: int = 0  # the publishing trainer start (``epoch.new_epoch``); 0 = unstamped

    @property
    def position(self) -> tuple[int, int]:
        """How receivers order frames: (epoch, version), see ``epoch``."""
        return (self.epoch, self.version)

    def to_record(self) -> bytes:
        return record(TAG_VERSION, MAGIC + struct.pack("<H", FORMAT_VERSION) + _json(asdict(self)))

    @classmethod
    def from_body(cls, body: bytes) -> VersionHeader:
        if body[:4] != MAGIC:
            raise CorruptFrameError("not a modal-rl weight-sync frame (bad magic)")
        (fmt,) = struct.unpack_from("<H", body, 4)
        if fmt != FORMAT_VERSION:
            why = f", written {FORMAT_HISTORY[fmt]}" if fmt in FORMAT_HISTORY else ""
            raise CorruptFrameError(
                f"frame format version {fmt}{why}, is not supported (this reader: {FORMAT_VERSION}); "
                "re-encode or re-publish it with this modal-rl"
            )
        data = _loads(body[6:], "version header")
        run, epoch = data.get("run"), data.get("epoch")
        if not isinstance(run, str) or not isinstance(epoch, int) or isinstance(epoch, bool):
            raise CorruptFrameError("the version header must name its run (text) and epoch (integer)")
        if not 0 <= epoch <= MAX_EPOCH:
            raise CorruptFrameError(f"epoch {epoch} is out of range")
        if set(data) - {f.name for f in fields(cls)}:
            raise CorruptFrameError(
                f"unknown version header keys {sorted(set(data) - {f.name for f in fields(cls)})}"
            )
        if data.get("kind") not in ("anchor", "delta"):
            raise CorruptFrameError(f"unknown frame kind {data.get('kind')!r}")
        if data["kind"] == "delta" and data.get("base_version") is None:
            raise CorruptFrameError("a delta frame must name its base version")
        return cls(**data)


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's manifest entry: its layout and its ls128 (anchor: of the new state; delta:
    of the base, the new one follows its chunks in the group's ``S`` record)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    checksum: str

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


# ntensors u32, chunk_elems u32, nchunks u32, total words u64; then the zstd-compressed entries.
GROUP_HEADER = struct.Struct("<IIIQ")
MAX_GROUP_TENSORS = 1 << 20
# The entries' decoded size is bounded before they are decoded: per declared tensor (its
# dtype, rank, shape, name and ls128 take well under 1 KiB), and in all, so a small record
# cannot make the reader inflate hundreds of MiB before it is refused.
MAX_ENTRY_BYTES_PER_TENSOR = 1024
MAX_GROUP_ENTRIES_BYTES = 8 << 20


@dataclass(frozen=True)
class GroupHeader:
    """A run of tensors of one word width whose words are coded as one concatenated space.

    Small tensors are grouped so that stream and table overheads are paid once per group,
    not once per tensor; a large tensor is a group of its own, split into chunks. A group
    of several tensors never exceeds one chunk.
    """

    tensors: tuple[TensorHeader, ...]
    chunk_elems: int
    nchunks: int

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.tensors)

    def body(self) -> bytes:
        entries = []
        for t in self.tensors:
            name = t.name.encode()
            entries.append(struct.pack("<BB", DTYPE_CODES[t.dtype], len(t.shape)))
            entries.append(struct.pack(f"<{len(t.shape)}QH", *t.shape, len(name)) + name)
            entries.append(bytes.fromhex(t.checksum))
        import zstandard  # lazily: a store's reader and the wire's framing never need it

        packed = zstandard.ZstdCompressor(level=3).compress(b"".join(entries))
        return GROUP_HEADER.pack(len(self.tensors), self.chunk_elems, self.nchunks, self.total) + packed

    @classmethod
    def from_body(cls, body: bytes) -> GroupHeader:
        if len(body) < GROUP_HEADER.size:
            raise CorruptFrameError("group header too short")
        ntensors, chunk_elems, nchunks, total = GROUP_HEADER.unpack_from(body)
        if not 0 < ntensors <= MAX_GROUP_TENSORS or chunk_elems == 0:
            raise CorruptFrameError(f"group header declares {ntensors} tensors, chunk size {chunk_elems}")
        import zstandard

        try:
            raw = _bounded_inflate(
                body[GROUP_HEADER.size :], min(ntensors * MAX_ENTRY_BYTES_PER_TENSOR, MAX_GROUP_ENTRIES_BYTES)
            )
        except zstandard.ZstdError as exc:
            raise CorruptFrameError(f"group header entries do not decode: {exc}") from exc
        tensors, offset = [], 0
        try:
            for _ in range(ntensors):
                code, ndim = struct.unpack_from("<BB", raw, offset)
                offset += 2
                *shape, name_len = struct.unpack_from(f"<{ndim}QH", raw, offset)
                offset += 8 * ndim + 2
                name = raw[offset : offset + name_len].decode()
                checksum = raw[offset + name_len : offset + name_len + 16].hex()
                offset += name_len + 16
                if code not in DTYPE_BY_CODE or len(checksum) != 32:
                    raise CorruptFrameError(f"group header entry {name!r} is malformed")
                tensors.append(TensorHeader(name, DTYPE_BY_CODE[code], tuple(shape), checksum))
        except (struct.error, UnicodeDecodeError) as exc:
            raise CorruptFrameError(f"group header entries are malformed: {exc}") from exc
        if offset != len(raw):
            raise CorruptFrameError("trailing bytes after the group header entries")
        header = cls(tuple(tensors), chunk_elems, nchunks)
        if header.total != total or nchunks != -(-total // chunk_elems):
            raise CorruptFrameError(f"group header: {nchunks} chunks of {chunk_elems} for {total} words")
        if ntensors > 1 and total > chunk_elems:
            raise CorruptFrameError("a group of several tensors spans more than one chunk")
        if len({ITEMSIZE[t.dtype] for t in tensors}) != 1:
            raise CorruptFrameError("a group mixes word widths")
        return header


def _bounded_inflate(data: bytes, limit: int) -> bytes:
    """``data`` inflated, or ``CorruptFrameError`` as soon as it passes ``limit`` bytes (read in
    steps: a frame's declared content size is never trusted for an allocation)."""
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(data)
    out = bytearray()
    while piece := reader.read(min(1 << 16, limit + 1 - len(out))):
        out += piece
        if len(out) > limit:
            raise CorruptFrameError(f"group header entries inflate past {limit} bytes")
    return bytes(out)


def sums_body(sums: dict[str, str]) -> bytes:
    """An ``S`` record's body: the ``state_digest`` of a delta's new tensor sums (16 bytes,
    whatever the tensor count: a sharded publisher's many pieces cost no more)."""
    return bytes.fromhex(state_digest(sums))


def read_sums_digest(body: bytes | memoryview) -> str:
    """The digest an ``S`` body carries; ``CorruptFrameError`` unless it is 16 bytes."""
    if len(body) != SUM_BYTES:
        raise CorruptFrameError(f"sums record of {len(body)} bytes (a delta's carries {SUM_BYTES})")
    return bytes(body).hex()


@dataclass(frozen=True)
class EndRecord:
    tensors: int
    manifest_digest: str

    def to_record(self) -> bytes:
        return record(TAG_END, _json(asdict(self)))


def stamp(records: Iterable[bytes], run: str, epoch: int) -> Iterator[bytes]:
    """One frame's unsigned records (as the codec writes them) with the version header
    rewritten to name ``run`` and ``epoch``. Signing happens after (the sink), so the MAC
    chain covers the stamped header. The end record's manifest digest covers only the
    group headers and sums records, so it stays valid."""
    it = iter(records)
    first = next(it, None)
    if first is None:
        return
    if first[:1] != TAG_VERSION:
        raise CorruptFrameError("frame does not start with a version header")
    header = VersionHeader.from_body(record_body(first))
    yield replace(header, run=run, epoch=epoch).to_record()
    yield from it


def state_digest(checksums: dict[str, str]) -> str:
    """One xxh3-128 over every tensor's name and checksum, independent of order."""
    h = xxhash.xxh3_128()
    for name in sorted(checksums):
        h.update(name.encode() + b"\0" + checksums[name].encode() + b"\n")
    return h.hexdigest()


def manifest_digest(tensor_bodies: Iterable[bytes]) -> str:
    h = xxhash.xxh3_128()
    for body in tensor_bodies:
        h.update(struct.pack("<I", len(body)))
        h.update(body)
    return h.hexdigest()


MAX_HEADER_JSON = 1 << 20  # a header names a few hundred tensors at most in its own record


def _loads(body: bytes, what: str) -> dict[str, Any]:
    try:
        data = wire_json.loads(body, max_bytes=MAX_HEADER_JSON, max_depth=8)
    except wire_json.WireError as exc:
        raise CorruptFrameError(f"{what} is refused: {exc}") from None
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


def record_body(raw: bytes) -> bytes:
    """The body of one whole record, signed or not (unverified: for transports)."""
    return raw[RECORD_HEADER.size : len(raw) - trailer_size(raw[:1])]


def record_tag(raw: bytes) -> bytes:
    """A record's tag in upper case (``V``, ``G``, ``C``, ``E``), signed or not."""
    return raw[:1].upper()


def read_records(stream: BinaryIO, *, keys: FrameKeys | None) -> Iterator[tuple[bytes, bytes]]:
    """Yield ``(tag, body)`` for each record of one frame, each only after it is verified.

    ``keys`` (``auth.frame_keys``): with keys, every record must be signed and its MAC
    match; ``None`` (explicitly keyless): every record must be unsigned. Tags are yielded
    in upper case either way. Stops cleanly at end of stream between records; raises
    ``TruncatedFrameError`` when the stream ends inside a record, ``CorruptFrameError`` when
    a checksum fails, and an ``AuthenticationError`` when a MAC or the signing mode does not.
    """
    return verify_records(split_records(stream), keys=keys)


def verify_records(
    raw_records: Iterable[tuple[bytes, bytes]], *, keys: FrameKeys | None
) -> Iterator[tuple[bytes, bytes]]:
    """``read_records`` over ``(tag, raw record)`` pairs a transport already split (e.g. as
    they arrive from a socket): each is verified before it is yielded."""
    verifier = Verifier(keys)
    for tag, raw in raw_records:
        yield tag.upper(), bytes(verifier.check(raw))


def split_records(stream: BinaryIO) -> Iterator[tuple[bytes, bytes]]:
    """Yield ``(tag, raw record bytes)`` without verifying digests: for transports that
    only move records along (the receiver's ``VersionChain`` verifies everything). The tag
    is as written: lower case for signed records."""
    while True:
        header = _read_exact(stream, RECORD_HEADER.size)
        if not header:
            return
        if len(header) < RECORD_HEADER.size:
            raise TruncatedFrameError("stream ends inside a record header")
        tag, length = RECORD_HEADER.unpack(header)
        if tag not in ALL_TAGS or length > MAX_RECORD_BYTES:
            raise CorruptFrameError(f"bad record header (tag {tag!r}, length {length})")
        rest = _read_exact(stream, length + trailer_size(tag))
        if len(rest) < length + trailer_size(tag):
            raise TruncatedFrameError(f"stream ends inside a {tag.decode().upper()} record")
        yield tag, header + rest
