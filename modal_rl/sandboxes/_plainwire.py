"""Plain data between the test runner and the program: the only thing that crosses (stdlib only).

Shipped into the sandbox as source (``testrun.runner_source``) and imported by the host's tests.
A value is exact ``None/bool/int/float/complex/str/bytes`` or a ``list/tuple/set/frozenset/dict``
of values, or a *reference* (``Ref``) to an object that stays on the side that owns it (a
program's instance travels as its number, never as itself). One message is a 4-byte length and
that many bytes of a single value.

Invariants (the decoder faces the program's bytes, and the program controls them):
- ``decode`` never recurses and never raises anything but ``WireError``; its work is O(input):
  every length is checked against what is left of the input before it is read, nesting is at
  most ``MAX_DEPTH``, values at most ``MAX_ITEMS``, ints at most ``MAX_INT_DIGITS`` digits;
- a set, frozenset or dict is refused if more than ``MAX_SAME_HASH`` of its keys share one hash
  (values built to collide would make building it quadratic), or a key is unhashable;
- ``encode`` takes exact types only (a subclass of ``int`` is not an ``int``: it travels as a
  reference, so nothing the program defines takes part in a comparison on the other side), is
  iterative, and refuses a value deeper, larger or longer than the same limits.
"""

import struct

MAX_MESSAGE = 8 << 20
MAX_DEPTH = 64
MAX_ITEMS = 200_000
MAX_INT_DIGITS = 4300
MAX_SAME_HASH = 8
_LEN = struct.Struct(">I")
_F64 = struct.Struct(">d")
_C128 = struct.Struct(">dd")
_SEQ_TAGS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}
_SEQ_TYPES = {b"l": list, b"t": tuple, b"S": set, b"Z": frozenset}


class WireError(Exception):
    """Bytes that are not one bounded plain value, or a value that cannot be sent."""


class Ref:
    """An object that stays on its owner's side, named by number (and, for messages, type name)."""

    __slots__ = ("num",)

    def __init__(self, num):
        self.num = num


def encode(value, ref_of=None):
    """``value`` as bytes. ``ref_of(obj) -> int | None`` names an object that is not plain data
    (None: refuse it). Raises ``WireError`` past the limits."""
    out = []
    stack = [(value, 0)]
    items = 0
    size = 0
    while stack:
        v, depth = stack.pop()
        items += 1
        if items > MAX_ITEMS or depth > MAX_DEPTH or size > MAX_MESSAGE:
            raise WireError("value too large or too deep to send")
        t = type(v)
        if v is None:
            piece = b"N"
        elif t is bool:
            piece = b"T" if v else b"F"
        elif t is int:
            digits = int.__repr__(v).encode()
            if len(digits) > MAX_INT_DIGITS + 1:
                raise WireError("int too large to send")
            piece = b"i" + _LEN.pack(len(digits)) + digits
        elif t is float:
            piece = b"f" + _F64.pack(v)
        elif t is complex:
            piece = b"c" + _C128.pack(v.real, v.imag)
        elif t is str:
            data = v.encode("utf-8", "surrogatepass")
            piece = b"s" + _LEN.pack(len(data)) + data
        elif t is bytes:
            piece = b"b" + _LEN.pack(len(v)) + v
        elif t in _SEQ_TAGS:
            members = list(v)
            piece = _SEQ_TAGS[t] + _LEN.pack(len(members))
            stack.extend((m, depth + 1) for m in reversed(members))
        elif t is dict:
            pairs = list(dict.items(v))
            piece = b"d" + _LEN.pack(len(pairs))
            for k, val in reversed(pairs):
                stack.append((val, depth + 1))
                stack.append((k, depth + 1))
        elif t is Ref:
            piece = b"h" + _LEN.pack(v.num)
        else:
            num = ref_of(v) if ref_of is not None else None
            if num is None:
                raise WireError(f"a {t.__name__} is not plain data")
            piece = b"h" + _LEN.pack(num)
        out.append(piece)
        size += len(piece)
    data = b"".join(out)
    if len(data) > MAX_MESSAGE:
        raise WireError("value too large to send")
    return data


def _checked_hashes(members):
    """Refuse members that are unhashable or collide (more than MAX_SAME_HASH per hash)."""
    counts = {}
    for m in members:
        try:
            h = hash(m)
        except TypeError:
            raise WireError("unhashable member of a set or dict key") from None
        # Hashes are ints below 2**61 in magnitude: distinct ones never collide in this dict.
        n = counts.get(h, 0) + 1
        if n > MAX_SAME_HASH:
            raise WireError("too many colliding keys")
        counts[h] = n


def _build(tag, members):
    if tag == b"d":
        keys = members[0::2]
        _checked_hashes(keys)
        return dict(zip(keys, members[1::2], strict=False))
    if tag in (b"S", b"Z"):
        _checked_hashes(members)
    return _SEQ_TYPES[tag](members)


def decode(data, make_ref=Ref):
    """The one value in ``data`` (bytes). ``make_ref(num)`` builds a reference's local stand-in."""
    n = len(data)
    if n > MAX_MESSAGE:
        raise WireError("message too large")
    pos = 0
    items = 0
    stack = []  # [tag, members still to read, members]
    result = None
    done = False
    view = memoryview(data)
    while not done:
        if pos >= n:
            raise WireError("message ends inside a value")
        items += 1
        if items > MAX_ITEMS:
            raise WireError("too many values")
        tag = data[pos : pos + 1]
        pos += 1
        value = None
        opened = False
        if tag == b"N":
            value = None
        elif tag == b"T" or tag == b"F":
            value = tag == b"T"
        elif tag in (b"i", b"s", b"b", b"l", b"t", b"S", b"Z", b"d", b"h"):
            if pos + 4 > n:
                raise WireError("message ends inside a length")
            (count,) = _LEN.unpack_from(data, pos)
            pos += 4
            if tag == b"h":
                value = make_ref(count)
            elif tag in (b"i", b"s", b"b"):
                if count > n - pos:
                    raise WireError("length past the end of the message")
                raw = view[pos : pos + count]
                pos += count
                if tag == b"i":
                    if count > MAX_INT_DIGITS + 1 or not _is_int_text(raw):
                        raise WireError("malformed int")
                    value = int(bytes(raw))
                elif tag == b"s":
                    try:
                        value = bytes(raw).decode("utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        raise WireError("malformed str") from None
                else:
                    value = bytes(raw)
            else:
                members = count * 2 if tag == b"d" else count
                if members > n - pos:  # every member takes at least one byte
                    raise WireError("count past the end of the message")
                if len(stack) >= MAX_DEPTH:
                    raise WireError("value nested too deeply")
                stack.append([tag, members, []])
                opened = True
        elif tag == b"f":
            if pos + 8 > n:
                raise WireError("message ends inside a float")
            (value,) = _F64.unpack_from(data, pos)
            pos += 8
        elif tag == b"c":
            if pos + 16 > n:
                raise WireError("message ends inside a complex")
            value = complex(*_C128.unpack_from(data, pos))
            pos += 16
        else:
            raise WireError("unknown tag")
        if opened and stack[-1][1] > 0:
            continue
        if opened:  # an empty container is complete at once
            top = stack.pop()
            value = _build(top[0], top[2])
        while True:  # hand the finished value to its container, closing those it completes
            if not stack:
                result, done = value, True
                break
            top = stack[-1]
            top[2].append(value)
            top[1] -= 1
            if top[1] > 0:
                break
            stack.pop()
            value = _build(top[0], top[2])
    if pos != n:
        raise WireError("bytes after the value")
    return result


def _is_int_text(raw):
    body = raw[1:] if len(raw) > 0 and raw[0] == 0x2D else raw  # a leading '-'
    return len(body) > 0 and all(0x30 <= c <= 0x39 for c in body)


def send_message(sock, value, ref_of=None):
    data = encode(value, ref_of)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock, count):
    """``count`` bytes from ``sock`` (honouring its timeout), or ``WireError`` at EOF."""
    parts = []
    while count > 0:
        chunk = sock.recv(min(count, 1 << 20))
        if not chunk:
            raise WireError("the other side closed the channel")
        parts.append(chunk)
        count -= len(chunk)
    return b"".join(parts)


def recv_message(sock, make_ref=Ref):
    (size,) = _LEN.unpack(recv_exact(sock, 4))
    if size > MAX_MESSAGE:
        raise WireError("message too large")
    return decode(recv_exact(sock, size), make_ref)
