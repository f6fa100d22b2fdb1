"""Host side of the verdict: decode the harness's strict values, evaluate an assert's template.

``decode`` is the inverse of ``_harness.encode``: it builds only plain builtins (anything else
is a ``ValueError``). ``host_eval`` walks the small expression language ``verdict`` produces
(constants, displays, unary/binary/boolean operators, comparisons, a fixed set of builtin and
``math`` calls, and ``__vN`` holes bound to decoded values): no ``eval``, no attribute access,
no names but the holes and a few builtin types. Operations whose cost a value could blow up
(``**``, ``<<``, repetition) are bounded, so a program's answer cannot stall the host.
"""

from __future__ import annotations

import ast
import base64
import math
import operator
from typing import Any

_SEQS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
_MAX_ITEMS = 1_000_000
BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
CALLS: dict[str, Any] = {
    **{f.__name__: f for f in (abs, len, sorted, set, frozenset, list, tuple, dict, round)},
    **{f.__name__: f for f in (min, max, sum, any, all, str, int, float, bool, isinstance, type)},
    **{f"math.{n}": getattr(math, n) for n in ("isclose", "fabs", "isnan", "isinf", "floor", "ceil")},
}
TYPES = {t.__name__: t for t in (int, float, str, bool, list, tuple, dict, set, bytes, complex, frozenset)}


def decode(enc: Any, budget: list[int] | None = None) -> Any:
    budget = budget if budget is not None else [_MAX_ITEMS]
    budget[0] -= 1
    if budget[0] < 0 or not isinstance(enc, list) or not enc or not isinstance(enc[0], str):
        raise ValueError("malformed value")
    tag, rest = enc[0], enc[1:]
    if tag == "none" and not rest:
        return None
    if tag == "bool" and len(rest) == 1 and isinstance(rest[0], bool):
        return rest[0]
    if tag == "int" and len(rest) == 1 and isinstance(rest[0], str) and len(rest[0]) <= 4300:
        return int(rest[0])
    if tag == "float" and len(rest) == 1 and isinstance(rest[0], str):
        return float.fromhex(rest[0])
    if tag == "complex" and len(rest) == 2 and all(isinstance(r, str) for r in rest):
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag == "str" and len(rest) == 1 and isinstance(rest[0], str):
        return rest[0]
    if tag == "bytes" and len(rest) == 1 and isinstance(rest[0], str):
        return base64.b64decode(rest[0], validate=True)
    if tag in _SEQS and len(rest) == 1 and isinstance(rest[0], list):
        return _SEQS[tag](decode(v, budget) for v in rest[0])
    if tag == "dict" and len(rest) == 1 and isinstance(rest[0], list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in rest[0]):
            raise ValueError("malformed dict")
        return {decode(k, budget): decode(v, budget) for k, v in rest[0]}
    raise ValueError(f"malformed value tagged {tag!r}")


def _size(v: Any) -> int:
    return len(v) if isinstance(v, str | bytes | list | tuple | set | frozenset | dict) else 0


def _binop(op: ast.operator, a: Any, b: Any) -> Any:
    if isinstance(op, ast.Pow) and isinstance(b, int) and abs(b) > 4096:
        raise ValueError("exponent too large to judge")
    if isinstance(op, ast.Mult) and (_size(a) * abs(b) if isinstance(b, int) else 0) > _MAX_ITEMS:
        raise ValueError("repetition too large to judge")
    if isinstance(op, ast.Mult) and (_size(b) * abs(a) if isinstance(a, int) else 0) > _MAX_ITEMS:
        raise ValueError("repetition too large to judge")
    return BINOPS[type(op)](a, b)


def host_eval(node: ast.expr, values: dict[str, Any]) -> Any:
    """Evaluate a template; any error propagates (the caller scores it as a failed assert)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in values:
            return values[node.id]
        return TYPES[node.id]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        items = [host_eval(e, values) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {
            host_eval(k, values): host_eval(v, values) for k, v in zip(node.keys, node.values, strict=True)
        }
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](host_eval(node.operand, values))
    if isinstance(node, ast.BinOp):
        return _binop(node.op, host_eval(node.left, values), host_eval(node.right, values))
    if isinstance(node, ast.BoolOp):
        result = None
        for v in node.values:  # short-circuit as Python does
            result = host_eval(v, values)
            if bool(result) != isinstance(node.op, ast.And):
                return result
        return result
    if isinstance(node, ast.Compare):
        left = host_eval(node.left, values)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = host_eval(comp, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLS:
        fn = CALLS[node.func.id]
        args = [host_eval(a, values) for a in node.args]
        kwargs = {k.arg: host_eval(k.value, values) for k in node.keywords}
        if fn is type and (len(args) != 1 or kwargs):
            raise ValueError("type() takes one value here")
        if fn in (str, int) and any(isinstance(a, int) and abs(a) > 10**4300 for a in args):
            raise ValueError("number too large to judge")
        return fn(*args, **kwargs)
    raise ValueError(f"cannot judge {ast.unparse(node)!r} on the host")
