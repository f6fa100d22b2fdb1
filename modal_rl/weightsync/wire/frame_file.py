"""Reading one frame from an untrusted file (a store's), without decoding it.

``read_frame_file`` is bounded by the lengths the format declares and the caps below, never
reads through a link, and verifies record by record while it reads; it needs the format
(``frames``, ``auth``) and nothing of the codec, so a store's reader loads no numba or zstd.
"""

from __future__ import annotations

import struct
from pathlib import Path

from modal_rl.weightsync.errors import CorruptFrameError, StoreFileError, TruncatedFrameError
from modal_rl.weightsync.transport.volumes import open_regular
from modal_rl.weightsync.wire.auth import FrameKeys, Verifier, trailer_size
from modal_rl.weightsync.wire.frames import GROUP_HEADER, MAX_RECORD_BYTES, RECORD_HEADER, VersionHeader

# Caps on one record before it is read from a file, so a planted file costs at most one
# capped record: V and E are a few hundred bytes of JSON, G is 20 bytes and its zstd-coded
# manifest entries, S 16 bytes, a chunk at most its words (8-byte words at most) and the
# coders' overhead.
SMALL_RECORD_BYTES = 1 << 20
GROUP_RECORD_BYTES = 64 << 20


def read_frame_file(
    path: Path, keys: FrameKeys | None, max_bytes: int | None = None
) -> tuple[bytes, VersionHeader]:
    """The frame stored in ``path`` and its version header, or a typed refusal.

    Two passes over one descriptor opened without following links (``open_regular``): the
    first walks the records, checking each header (tag, order, length within its cap and
    within the file) before reading the body into a reused buffer, and verifying it (MAC,
    keyed; digest) before the next; it stops at the end record, and bytes after it are
    refused. Only then is the frame, exactly that long, read whole — so memory is one frame
    of this run, or one capped record of anything else."""
    fd, st = open_regular(path, max_bytes)
    with open(fd, "rb", closefd=True) as f:
        verifier, buf = Verifier(keys), bytearray()
        header, pos, chunks_left, chunk_cap, summed = None, 0, 0, 0, False
        while True:
            head = f.read(RECORD_HEADER.size)
            if len(head) < RECORD_HEADER.size:
                raise TruncatedFrameError(f"{path} ends before its end record")
            tag, length = RECORD_HEADER.unpack(head)
            kind = tag.upper()
            if header is None or chunks_left:
                allowed = (b"V",) if header is None else (b"C",)
            else:  # a delta's S record follows its last chunk, and only E follows it
                allowed = (b"E",) if summed else (b"G", b"S") if header.kind == "delta" else (b"G", b"E")
            if kind not in allowed:
                raise CorruptFrameError(f"{path}: record {tag!r} where {b'/'.join(allowed).decode()} belongs")
            cap = {b"C": chunk_cap, b"G": GROUP_RECORD_BYTES}.get(kind, SMALL_RECORD_BYTES)
            total = RECORD_HEADER.size + length + trailer_size(tag)
            if length > cap or pos + total > st.st_size:
                where = "over its cap" if length > cap else "past the end of the file"
                raise StoreFileError(
                    f"{path}: a {kind.decode()} record declares {length} bytes, {where}; refused"
                )
            if len(buf) < total:
                buf = bytearray(total)
            view = memoryview(buf)[:total]
            view[: RECORD_HEADER.size] = head
            if f.readinto(view[RECORD_HEADER.size :]) != total - RECORD_HEADER.size:
                raise TruncatedFrameError(f"{path} ends inside a {kind.decode()} record")
            body = verifier.check(view)
            if kind == b"V":
                header = _version_header(bytes(body), path)
            elif kind == b"G":
                chunks_left, chunk_cap = _group_chunks(body)
            elif kind == b"C":
                chunks_left -= 1
            elif kind == b"S":
                summed = True
            pos += total
            if kind == b"E":
                break
        if pos != st.st_size:
            raise StoreFileError(f"{path} has {st.st_size - pos} bytes after its end record; refused")
        f.seek(0)
        data = f.read(pos)
    if len(data) != pos:
        raise TruncatedFrameError(f"{path} changed while it was read")
    return data, header


def _version_header(body: bytes, path: Path) -> VersionHeader:
    try:
        return VersionHeader.from_body(body)
    except (TypeError, ValueError, KeyError, struct.error) as exc:  # keyless: anyone's bytes
        raise CorruptFrameError(f"{path}: malformed version header ({type(exc).__name__})") from None


def _group_chunks(body: memoryview) -> tuple[int, int]:
    """A verified group header's chunk count, and the cap on each of its chunk records."""
    if len(body) < GROUP_HEADER.size:
        raise CorruptFrameError("group header too short")
    _, chunk_elems, nchunks, _ = GROUP_HEADER.unpack_from(body)
    return nchunks, min(MAX_RECORD_BYTES, 16 * chunk_elems + (1 << 20))
