"""Values between the test runner and the program, with Python's meaning (stdlib only).

Shipped into the sandbox as source (``testrun.runner_source``) and imported by the host's tests.
One message is a 4-byte length and that many bytes of a single value. A value is:
- exact ``None/bool/int/float/complex/str/bytes/bytearray`` (ints of any size, as two's-complement
  bytes: no digit limit, linear to encode and decode), or a ``list/tuple/set/frozenset/dict`` of
  values;
- a stdlib value type (``KINDS``: ``Counter``, ``OrderedDict``, ``defaultdict`` of a builtin
  factory, ``deque``, ``datetime``/``date``/``time``/``timedelta``/``timezone``, ``Decimal``,
  ``Fraction``, ``range``, namedtuples, an iterator drained to its items), rebuilt on the other
  side as the same type;
- an *object by value* (``Obj``): an instance of a class the receiver knows by name (the test's
  own ``ListNode``/``TreeNode``...), sent as its class name and attributes and rebuilt there as
  that side's class of the same name; objects are numbered, so shared nodes and cycles keep
  their shape, and an object the receiver sent comes back as *the same object*, updated in place;
- a *reference* (``Ref``) to an object that stays on the side that owns it: ``h`` for the
  program's objects (with a kind the runner uses to decide which protocol it may speak to it),
  ``H`` for the runner's (a test's callback).

Invariants (the decoder faces the program's bytes, and the program controls them):
- ``decode`` never recurses and never raises anything but ``ValueWireError``; its work is O(input):
  every length is checked against what is left before it is read, values are at most
  ``MAX_ITEMS``, names at most ``MAX_NAME`` bytes, containers nest at most ``MAX_DEPTH`` deep
  (hashing and comparing a value recurse in C through its containers); objects by value do not
  count towards the depth (they hash by identity), so a 100k-node linked list is a value;
- a set, frozenset or dict is refused if more than ``MAX_SAME_HASH`` of its keys share one hash
  (values built to collide would make building it quadratic), or a key is unhashable;
- hashing and rebuilding use only the receiver's classes: a stdlib type's constructor, or the
  receiver's class of that name (``cls.__new__`` and ``__dict__``, never ``__init__``);
- ``encode`` takes exact types only (a subclass of ``int`` is not an ``int``: it travels as a
  reference, so nothing one side defines takes part in a comparison on the other), is
  iterative, and refuses a value larger than the same limits.
"""

import struct

try:  # on the host (tests); in the sandbox the runner script provides the module
    from modal_rl.sandboxes._valuekinds import (
        ValueWireError,
        build_kind,
        checked_hashes,
        pairs,
        stdlib_kind,
    )
except ImportError:
    from _valuekinds import ValueWireError, build_kind, checked_hashes, pairs, stdlib_kind

MAX_MESSAGE = 64 << 20
MAX_ITEMS = 4_000_000
MAX_NAME = 256
MAX_DEPTH = 5000  # containers inside containers (C-level hash and repr recurse through them)
_LEN = struct.Struct(">I")
_I32 = struct.Struct(">i")
_F64 = struct.Struct(">d")
_C128 = struct.Struct(">dd")
_SEQ_TAGS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}
_SEQ_TYPES = {b"l": list, b"t": tuple, b"S": set, b"Z": frozenset}


class Ref:
    """An object that stays on its owner's side, named by number; ``kind`` says what it is (the
    owner's claim, used only to choose which requests the other side sends); ``runner``: the
    runner owns it (tag ``H``), else the program (tag ``h``)."""

    __slots__ = ("num", "kind", "runner")

    def __init__(self, num, kind="", runner=False):
        self.num, self.kind, self.runner = num, kind, runner


def _int_bytes(v):
    return v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True)


class Encoder:
    """Encodes values for one side. ``by_value(obj) -> class name | None`` says which instances
    travel as objects by value; ``ref_of(obj) -> Ref | None`` names one that stays here;
    ``origin_of(obj) -> int`` gives an object received by value the number it came with (it
    then goes back as that object, updated)."""

    def __init__(self, by_value=None, ref_of=None, origin_of=None):
        self.by_value, self.ref_of, self.origin_of = by_value, ref_of, origin_of
        self.sent = []  # objects sent by value, in order: their numbers in this message are 1..n

    def encode(self, value):
        self.sent = []
        out = []
        stack = [value]
        items = size = 0
        seen = {}
        while stack:
            v = stack.pop()
            items += 1
            if items > MAX_ITEMS or size > MAX_MESSAGE:
                raise ValueWireError("value too large to send")
            t = type(v)
            # the shapes of a call and its answer first, inline (a round trip is ~10 of them)
            if t is int and -0x80000000 <= v <= 0x7FFFFFFF:
                piece = b"j" + _I32.pack(v)
            elif t is str and len(v) < 256 and v.isascii():
                piece = b"a" + bytes((len(v),)) + v.encode()
            elif v is None:
                piece = b"N"
            elif t is tuple or t is list:
                stack.extend(reversed(v))
                piece = (b"t" if t is tuple else b"l") + _LEN.pack(len(v))
            elif t is dict and not v:
                piece = b"d\x00\x00\x00\x00"
            else:
                piece = self._piece(v, stack, seen)
            out.append(piece)
            size += len(piece)
        data = b"".join(out)
        if len(data) > MAX_MESSAGE:
            raise ValueWireError("value too large to send")
        return data

    def _piece(self, v, stack, seen):
        t = type(v)
        if v is None:
            return b"N"
        if t is bool:
            return b"T" if v else b"F"
        if t is int:
            raw = _int_bytes(v)
            return b"i" + _LEN.pack(len(raw)) + raw
        if t is float:
            return b"f" + _F64.pack(v)
        if t is complex:
            return b"c" + _C128.pack(v.real, v.imag)
        if t is str:
            data = v.encode("utf-8", "surrogatepass")
            return b"s" + _LEN.pack(len(data)) + data
        if t is bytes or t is bytearray:
            return (b"b" if t is bytes else b"B") + _LEN.pack(len(v)) + bytes(v)
        if t in _SEQ_TAGS:
            members = list(v) if t is not list else v
            stack.extend(reversed(members))
            return _SEQ_TAGS[t] + _LEN.pack(len(members))
        if t is dict:
            pairs = list(dict.items(v))
            for k, val in reversed(pairs):
                stack.append(val)
                stack.append(k)
            return b"d" + _LEN.pack(len(pairs))
        if t is Ref:
            return _ref_piece(v)
        kind = stdlib_kind(v, t)
        if kind is not None:
            name, members = kind
            stack.extend(reversed(members))
            return b"x" + _name(name) + _LEN.pack(len(members))
        if id(v) in seen:
            return b"r" + _LEN.pack(seen[id(v)])
        cls_name = self.by_value(v) if self.by_value is not None else None
        if cls_name is not None:
            attrs = _attrs_of(v)
            self.sent.append(v)
            seen[id(v)] = len(self.sent)
            origin = (self.origin_of(v) or 0) if self.origin_of is not None else 0
            for k, val in reversed(attrs):
                stack.append(val)
                stack.append(k)
            return b"o" + _name(cls_name) + _LEN.pack(origin) + _LEN.pack(len(attrs))
        ref = self.ref_of(v) if self.ref_of is not None else None
        if ref is None:
            raise ValueWireError(f"a {t.__name__} cannot be sent")
        return _ref_piece(ref)


def _ref_piece(ref):
    return (b"H" if ref.runner else b"h") + _LEN.pack(ref.num) + _name(ref.kind)


def _name(text):
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_NAME:
        raise ValueWireError("name too long to send")
    return bytes([len(data)]) + data


def _attrs_of(v):
    attrs = getattr(v, "__dict__", None)
    pairs = [(k, val) for k, val in attrs.items() if type(k) is str] if type(attrs) is dict else []
    for slot in getattr(type(v), "__slots__", ()) if not pairs else ():
        if type(slot) is str and hasattr(v, slot):
            pairs.append((slot, getattr(v, slot)))
    return pairs


def encode(value, ref_of=None):
    """``value`` as bytes; ``ref_of(obj) -> Ref | None`` names what is not a value."""
    return Encoder(ref_of=ref_of).encode(value)


def _build(tag, members, classes, cache):
    if tag == b"d":
        return dict(pairs(members))
    if tag in (b"S", b"Z"):
        checked_hashes(members)
    return _SEQ_TYPES[tag](members)


class Decoder:
    """Decodes one side's values. ``classes`` maps a class name to the class an object by value
    is rebuilt as (``new_class(name)`` makes one where the name is unknown, or refuses it);
    ``make_ref(Ref)`` builds a reference's stand-in; ``origins`` are the objects this side sent
    in the message being answered (an object coming back with number k is ``origins[k-1]``)."""

    def __init__(self, classes=None, new_class=None, make_ref=None, origins=()):
        self.classes = classes if classes is not None else {}
        self.new_class, self.make_ref, self.origins = new_class, make_ref, origins
        self.received = []  # (object, origin) of each object by value, in order
        self._nt_cache = {}

    def _object(self, name, origin):
        if 0 < origin <= len(self.origins):
            obj = self.origins[origin - 1]
            return obj
        cls = self.classes.get(name)
        if not isinstance(cls, type) and self.new_class is not None:
            cls = self.new_class(name)
        if not isinstance(cls, type):
            raise ValueWireError(f"no class {name!r} to rebuild an object as")
        try:
            return cls.__new__(cls)
        except Exception:
            raise ValueWireError(f"class {name!r} cannot be rebuilt") from None

    def decode(self, data):
        n = len(data)
        if n > MAX_MESSAGE:
            raise ValueWireError("message too large")
        pos = items = depth = 0
        stack = []  # [tag, members still to read, members, extra]
        view = memoryview(data)
        while True:
            if pos >= n:
                raise ValueWireError("message ends inside a value")
            items += 1
            if items > MAX_ITEMS:
                raise ValueWireError("too many values")
            tag = data[pos : pos + 1]
            pos += 1
            opened = None  # [tag, count, members, extra] of a container opened here
            if tag == b"j":
                if pos + 4 > n:
                    raise ValueWireError("message ends inside an int")
                (value,) = _I32.unpack_from(data, pos)
                pos += 4
            elif tag == b"a":
                if pos >= n or pos + 1 + data[pos] > n:
                    raise ValueWireError("message ends inside a str")
                end = pos + 1 + data[pos]
                raw = data[pos + 1 : end]
                if not raw.isascii():
                    raise ValueWireError("malformed str")
                value = raw.decode()
                pos = end
            elif tag == b"N":
                value = None
            elif tag == b"t" or tag == b"l":
                if pos + 4 > n:
                    raise ValueWireError("message ends inside a length")
                (count,) = _LEN.unpack_from(data, pos)
                pos += 4
                opened = [tag, count, [], None]
            elif tag == b"T" or tag == b"F":
                value = tag == b"T"
            elif tag == b"f":
                if pos + 8 > n:
                    raise ValueWireError("message ends inside a float")
                (value,) = _F64.unpack_from(data, pos)
                pos += 8
            elif tag == b"c":
                if pos + 16 > n:
                    raise ValueWireError("message ends inside a complex")
                value = complex(*_C128.unpack_from(data, pos))
                pos += 16
            elif tag == b"h" or tag == b"H":
                num, pos = _read_len(data, pos, n)
                kind, pos = _read_name(data, pos, n)
                ref = Ref(num, kind, runner=tag == b"H")
                value = self.make_ref(ref) if self.make_ref is not None else ref
            elif tag == b"x":
                name, pos = _read_name(data, pos, n)
                count, pos = _read_len(data, pos, n)
                opened = [tag, count, [], name]
            elif tag == b"o":
                name, pos = _read_name(data, pos, n)
                origin, pos = _read_len(data, pos, n)
                count, pos = _read_len(data, pos, n)
                obj = self._object(name, origin)
                self.received.append((obj, origin))
                opened = [tag, count * 2, [], obj]
            elif tag in (b"i", b"s", b"b", b"B", b"l", b"t", b"S", b"Z", b"d", b"r"):
                count, pos = _read_len(data, pos, n)
                if tag in (b"i", b"s", b"b", b"B"):
                    if count > n - pos:
                        raise ValueWireError("length past the end of the message")
                    raw = view[pos : pos + count]
                    pos += count
                    value = _scalar(tag, raw)
                elif tag == b"r":
                    if not 0 < count <= len(self.received):
                        raise ValueWireError("reference to an object not yet sent")
                    value = self.received[count - 1][0]
                else:
                    opened = [tag, count * 2 if tag == b"d" else count, [], None]
            else:
                raise ValueWireError("unknown tag")
            if opened is not None:
                if opened[1] > n - pos:  # every member takes at least one byte
                    raise ValueWireError("count past the end of the message")
                if opened[1] > 0:
                    if tag != b"o":
                        depth += 1
                        if depth > MAX_DEPTH:
                            raise ValueWireError("value nested too deeply")
                    stack.append(opened)
                    continue
                value = self._close(opened)
            while True:  # hand the finished value to its container, closing those it completes
                if not stack:
                    if pos != n:
                        raise ValueWireError("bytes after the value")
                    return value
                top = stack[-1]
                top[2].append(value)
                top[1] -= 1
                if top[1] > 0:
                    break
                stack.pop()
                if top[0] != b"o":
                    depth -= 1
                value = self._close(top)

    def _close(self, top):
        tag, _, members, extra = top
        if tag == b"x":
            return build_kind(extra, members, self.classes, self._nt_cache)
        if tag == b"o":
            attrs = members[0::2]
            if not all(type(k) is str for k in attrs):
                raise ValueWireError("malformed object attributes")
            state = dict(zip(attrs, members[1::2], strict=False))
            try:
                d = object.__getattribute__(extra, "__dict__")
                d.clear()
                d.update(state)
            except (AttributeError, TypeError):
                for k, v in state.items():
                    try:
                        object.__setattr__(extra, k, v)
                    except Exception:
                        raise ValueWireError("object attributes cannot be set") from None
            return extra
        return _build(tag, members, self.classes, self._nt_cache)


def _read_len(data, pos, n):
    if pos + 4 > n:
        raise ValueWireError("message ends inside a length")
    return _LEN.unpack_from(data, pos)[0], pos + 4


def _read_name(data, pos, n):
    if pos >= n:
        raise ValueWireError("message ends inside a name")
    size = data[pos]
    if pos + 1 + size > n:
        raise ValueWireError("message ends inside a name")
    try:
        return bytes(data[pos + 1 : pos + 1 + size]).decode("utf-8", "surrogatepass"), pos + 1 + size
    except UnicodeDecodeError:
        raise ValueWireError("malformed name") from None


def _scalar(tag, raw):
    if tag == b"i":
        return int.from_bytes(raw, "big", signed=True)
    if tag == b"s":
        try:
            return bytes(raw).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise ValueWireError("malformed str") from None
    return bytes(raw) if tag == b"b" else bytearray(raw)


def decode(data, make_ref=None):
    """The one value in ``data``; references become ``make_ref(Ref)`` (default: the Ref)."""
    return Decoder(make_ref=make_ref).decode(data)


class Reader:
    """Messages from a socket, read in large pieces (one ``recv`` usually holds a whole small
    message: one system call per message, not two); lengths are checked before the body is."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def _fill(self, need):
        parts, have = [self.buf], len(self.buf)
        while have < need:
            chunk = self.sock.recv(max(1 << 16, min(need - have, 1 << 22)))
            if not chunk:
                raise ValueWireError("the other side closed the channel")
            parts.append(chunk)
            have += len(chunk)
        self.buf = b"".join(parts)

    def message(self):
        if len(self.buf) < 4:
            self._fill(4)
        (size,) = _LEN.unpack_from(self.buf, 0)
        if size > MAX_MESSAGE:
            raise ValueWireError("message too large")
        if len(self.buf) < 4 + size:
            self._fill(4 + size)
        data, self.buf = self.buf[4 : 4 + size], self.buf[4 + size :]
        return data
