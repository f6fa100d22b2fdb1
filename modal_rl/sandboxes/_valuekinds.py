"""Which stdlib values cross the test runner's wire by value, and how each is rebuilt (stdlib only).

Part of ``_plainwire`` (the format), kept apart because it is its own question: a value of one
of these types is sent as a kind name and its members, and rebuilt on the other side *by that
side's own constructor* (``build_kind``), so nothing the sender defines runs there. Every
constructor's refusal of bad members is a ``ValueWireError``; a mapping's keys are checked for
collisions before a dict is built (``pairs``).
"""

import collections
import sys

MAX_SAME_HASH = 8
_FACTORIES = {"int": int, "list": list, "set": set, "dict": dict, "str": str, "float": float, "tuple": tuple}
_FACTORY_NAMES = {v: k for k, v in _FACTORIES.items()}
_FACTORY_NAMES[None] = "None"


class ValueWireError(Exception):
    """Bytes that are not one bounded value, or a value that cannot be sent."""


def _namedtuple_fields(v):
    fields = getattr(type(v), "_fields", None)
    return fields if type(fields) is tuple and all(type(f) is str for f in fields) else None


def stdlib_kind(v, t):
    """(kind, members) for a stdlib value type, else None. Modules are looked up, not imported:
    a value of theirs exists only once they are (and importing them costs each run ~20 ms)."""
    datetime, decimal, fractions = (sys.modules.get(m) for m in ("datetime", "decimal", "fractions"))
    if t is collections.Counter or t is collections.OrderedDict:
        return t.__name__, _flat_items(v)
    if t is collections.defaultdict:
        factory = _FACTORY_NAMES.get(v.default_factory)
        return (f"defaultdict:{factory}", _flat_items(v)) if factory else None
    if t is collections.deque:
        return f"deque:{'' if v.maxlen is None else v.maxlen}", list(v)
    if datetime is not None and t is datetime.datetime:
        parts = [v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.fold]
        return "datetime", parts + [_tz_offset(v.tzinfo)]
    if datetime is not None and t is datetime.date:
        return "date", [v.year, v.month, v.day]
    if datetime is not None and t is datetime.time:
        return "time", [v.hour, v.minute, v.second, v.microsecond, v.fold, _tz_offset(v.tzinfo)]
    if datetime is not None and t is datetime.timedelta:
        return "timedelta", [v.days, v.seconds, v.microseconds]
    if datetime is not None and t is datetime.timezone:
        return "timezone", [_tz_offset(v)]
    if decimal is not None and t is decimal.Decimal:
        return "Decimal", [str(v)]
    if fractions is not None and t is fractions.Fraction:
        return "Fraction", [v.numerator, v.denominator]
    if t is range:
        return "range", [v.start, v.stop, v.step]
    if t.__module__ == "numpy":
        return _numpy_kind(v)
    if issubclass(t, tuple) and _namedtuple_fields(v) is not None and t.__name__.isidentifier():
        return f"namedtuple:{t.__name__}", [list(_namedtuple_fields(v)), *tuple.__iter__(v)]
    return None


def _numpy_kind(v):
    """A numpy scalar as the Python scalar it holds; a numeric array as dtype, shape and bytes."""
    shape = getattr(v, "shape", None)
    if shape == () and hasattr(v, "item"):
        return "scalar", [v.item()]
    dtype = getattr(v, "dtype", None)
    if type(shape) is tuple and dtype is not None and dtype.kind in "biufc":
        return "ndarray", [dtype.str, list(shape), v.tobytes(order="C")]
    if type(shape) is tuple and hasattr(v, "tolist"):
        return "ndarray-list", [v.tolist()]
    return None


def _ndarray(members, as_list):
    try:
        import numpy
    except ImportError:
        raise ValueWireError("an array arrived and numpy is not here") from None
    if as_list:
        return numpy.array(members[0], dtype=object if members[0] != [] else None)
    dtype_str, shape, raw = members
    dtype = numpy.dtype(dtype_str)
    if (
        dtype.kind not in "biufc"
        or type(raw) is not bytes
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ValueWireError("malformed array")
    return numpy.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _flat_items(v):
    return [x for pair in dict.items(v) for x in pair]


def _tz_offset(tz):
    if tz is None:
        return None
    if type(tz).__name__ != "timezone" or type(tz).__module__ != "datetime":
        raise ValueWireError("only fixed-offset time zones cross")
    off = tz.utcoffset(None)
    return [off.days, off.seconds, off.microseconds]


def checked_hashes(members):
    """Refuse members that are unhashable or collide (more than MAX_SAME_HASH per hash)."""
    counts = {}
    for m in members:
        try:
            h = hash(m)
        except Exception:
            raise ValueWireError("unhashable member of a set or dict key") from None
        # Hashes are ints below 2**61 in magnitude: distinct ones never collide in this dict.
        n = counts.get(h, 0) + 1
        if n > MAX_SAME_HASH:
            raise ValueWireError("too many colliding keys")
        counts[h] = n


def pairs(members):
    if len(members) % 2:
        raise ValueWireError("a mapping's items do not pair up")
    keys = members[0::2]
    checked_hashes(keys)
    return list(zip(keys, members[1::2], strict=False))


def _tz(spec):
    import datetime

    if spec is None:
        return None
    if type(spec) is not list or len(spec) != 3:
        raise ValueWireError("malformed time zone")
    return datetime.timezone(datetime.timedelta(*spec))


def _namedtuple(name, fields, cache):
    key = (name, tuple(fields))
    if key not in cache:
        if len(fields) > 255 or not all(type(f) is str for f in fields):
            raise ValueWireError("malformed namedtuple")
        cache[key] = collections.namedtuple(name, fields)
    return cache[key]


def build_kind(name, members, classes, cache):
    """The stdlib value ``name`` from its decoded ``members`` (constructor errors: ValueWireError)."""
    head, _, arg = name.partition(":")
    if head in ("datetime", "date", "time", "timedelta"):
        import datetime
    elif head == "Decimal":
        import decimal
    elif head == "Fraction":
        import fractions
    try:
        if head in ("Counter", "OrderedDict"):
            return getattr(collections, head)(dict(pairs(members)))
        if head == "defaultdict":
            if arg not in _FACTORIES and arg != "None":
                raise ValueWireError("defaultdict factory not allowed")
            return collections.defaultdict(_FACTORIES.get(arg), pairs(members))
        if head == "deque":
            return collections.deque(members, int(arg) if arg else None)
        if head == "datetime" and len(members) == 9:
            *parts, fold, tz = members
            return datetime.datetime(*parts, tzinfo=_tz(tz), fold=fold)
        if head == "date":
            return datetime.date(*members)
        if head == "time" and len(members) == 6:
            *parts, fold, tz = members
            return datetime.time(*parts, tzinfo=_tz(tz), fold=fold)
        if head == "timedelta":
            return datetime.timedelta(*members)
        if head == "timezone" and len(members) == 1:
            return _tz(members[0])
        if head == "Decimal" and len(members) == 1 and type(members[0]) is str:
            return decimal.Decimal(members[0])
        if head == "Fraction" and len(members) == 2 and all(type(m) is int for m in members):
            return fractions.Fraction(*members)
        if head == "range" and all(type(m) is int for m in members):
            return range(*members)
        if head == "iter":
            return iter(members)
        if head == "scalar" and len(members) == 1:
            return members[0]
        if head in ("ndarray", "ndarray-list") and len(members) == (3 if head == "ndarray" else 1):
            return _ndarray(members, head == "ndarray-list")
        if head == "namedtuple" and members and type(members[0]) is list:
            cls = classes.get(arg)
            fields = members[0]
            if not (isinstance(cls, type) and getattr(cls, "_fields", None) == tuple(fields)):
                cls = _namedtuple(arg, fields, cache)
            return cls(*members[1:])
    except ValueWireError:
        raise
    except Exception as exc:  # a constructor refusing the program's arguments
        raise ValueWireError(f"malformed {head}: {type(exc).__name__}") from None
    raise ValueWireError(f"unknown value kind {head!r}")
