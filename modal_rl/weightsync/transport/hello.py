"""The frame server's handshake lines, read with bounds: each line at most ``MAX_LINE`` bytes,
JSON of bounded depth (``wire_json``), counters in u64. Anything else is a ``Refused`` whose
message the server sends back and logs on one line (``transport.tcp``).
"""

from __future__ import annotations

import asyncio

from modal_rl import wire_json

MAX_LINE = 4096
MAX_COUNTER = (1 << 64) - 1  # versions and epochs are u64 on the wire (frames)


class Refused(Exception):
    """A receiver failed admission; the message is sent to it and logged (one line)."""


async def read_line(reader: asyncio.StreamReader) -> bytes:
    """One line of at most ``MAX_LINE`` bytes (the reader's limit); longer is a refusal."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise Refused(f"a handshake line over {MAX_LINE} bytes") from None
    except asyncio.IncompleteReadError as exc:
        if len(exc.partial) >= MAX_LINE:
            raise Refused(f"a handshake line over {MAX_LINE} bytes") from None
        raise


def parse(line: bytes, what: str) -> dict:
    """A handshake line as a JSON object, bounded (``wire_json``); ``Refused`` otherwise."""
    try:
        obj = wire_json.loads(line, max_bytes=MAX_LINE, max_depth=4)
    except wire_json.WireError as exc:
        raise Refused(f"the {what} is refused: {exc}") from None
    if not isinstance(obj, dict):
        raise Refused(f"the {what} is not a JSON object")
    return obj


def counter(hello: dict, name: str) -> int | None:
    """A version or epoch the hello names (None: it names none); out of range is a refusal."""
    value = hello.get(name)
    if value is None:
        return None
    got = wire_json.int_in(value, 0, MAX_COUNTER)
    if got is None:
        raise Refused(f"the hello's {name!r} must be an integer in 0..2**64-1")
    return got
