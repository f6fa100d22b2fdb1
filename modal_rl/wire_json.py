"""Bounded, total JSON for everything that arrives from a peer or a shared store.

Every wire and store parser of the project that reads JSON (the frame server's hello and
proof lines, the receiver's reading of the server's answer, the cluster's control channel,
frame headers, lease and ``latest`` records, volume markers) goes through ``loads``, so that
any input, however hostile, ends in a ``WireError``: one line naming what is wrong, a
``ValueError`` that callers already turn into a refusal. Never a ``RecursionError`` (deep
nesting), an ``OverflowError`` (a 10**400 integer reaching ``math`` or ``float``) or a
traceback per connection.

Invariants of ``loads(data, max_bytes=..., max_depth=...)``:
- input over ``max_bytes`` is refused before it is decoded;
- nesting deeper than ``max_depth`` is refused before ``json`` recurses into it;
- integers have at most ``MAX_INT_DIGITS`` digits; ``NaN`` / ``Infinity`` and floats that
  overflow to infinity are refused: every number that comes back is finite and bounded;
- it raises ``WireError`` and nothing else (tested with hypothesis, ``tests/weightsync/test_wire_fuzz.py``).

``int_in(value, lo, hi)`` is the range check for an integer field once parsed.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

MAX_INT_DIGITS = 40  # 2**128 has 39 digits: more than any epoch, version or size we use
DEFAULT_DEPTH = 16
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_DEPTH = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class WireError(ValueError):
    """Input a parser refuses; the message is one line, and names no secret."""


def _int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise WireError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    if len(text) > 64:
        raise WireError(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise WireError("a number out of the float range")
    return value


def _constant(name: str):
    raise WireError(f"{name} is not a JSON number")


def depth(data: bytes) -> int:
    """How deeply ``data``'s arrays and objects nest (brackets inside strings do not count)."""
    stripped = _STRINGS.sub(b"", data)
    opened = stripped.count(b"[") + stripped.count(b"{")
    if opened <= 1:
        return opened
    return max(accumulate(_DEPTH.get(b, 0) for b in stripped), default=0)


def loads(
    data: bytes | bytearray | memoryview | str, *, max_bytes: int, max_depth: int = DEFAULT_DEPTH
) -> Any:
    """``json.loads(data)`` within the bounds above; ``WireError`` (one line) otherwise."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise WireError(f"{len(raw)} bytes, over the {max_bytes}-byte limit")
    if depth(raw) > max_depth:
        raise WireError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except WireError:
        raise
    except RecursionError:  # unreachable after the depth check; kept so the promise holds
        raise WireError("nested too deeply") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise WireError(f"not valid JSON ({type(exc).__name__})") from None


def int_in(value: Any, lo: int, hi: int) -> int | None:
    """``value`` when it is an integer (not a bool) in ``lo..hi``, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
        return value
    return None
