"""The program's side of a test run: the model's code as a module that answers calls (stdlib only).

Runs in the program process that ``_runner`` starts, isolated from it, and holds nothing but its
end of one socket and a copy of stderr. Nothing here is trusted: the program can replace any of
it, so the runner treats every byte it gets as an adversary's (``_plainwire.decode``).

Protocol (each message one ``_plainwire`` value):
- first, from here: ``("ready", [(name, kind, value)...])`` with kind ``"func"`` (a callable),
  ``"class"``, ``"value"`` (plain data or a reference); or ``("load_error", type, message)``;
- then requests from the runner, one at a time, each answered once:
  ``("call", obj, attr, args, kwargs)``: ``obj`` a top-level name or a reference, ``attr`` a
  method name or None; ``("getattr", ref, name)``; ``("op", ref, op, args)`` for the few
  builtins a test applies to an object (``len``, ``bool``, ``str``, ``list``, ``getitem``,
  ``contains``). Answers: ``("ok", value, writeback)`` (writeback: the new value of each list,
  dict or set positional argument, else None), ``("method",)`` for a callable attribute,
  ``("err", builtin_exception_name, message)``.
A result that is not plain data stays here and travels as a reference (``Ref``).
"""

import operator

try:  # on the host (tests); in the sandbox the runner script provides the module
    from modal_rl.sandboxes import _plainwire as wire
except ImportError:
    import _plainwire as wire

_OPS = {
    "len": len,
    "bool": bool,
    "str": str,
    "list": list,
    "getitem": operator.getitem,
    "contains": operator.contains,
}
_MUTABLE = (list, dict, set)


class _Objects:
    """The program's objects the runner holds a reference to, by number."""

    def __init__(self):
        self.by_num = {}
        self.by_id = {}

    def ref_of(self, obj):
        num = self.by_id.get(id(obj))
        if num is None:
            num = len(self.by_num) + 1
            self.by_num[num] = obj
            self.by_id[id(obj)] = num
        return num

    def get(self, ref):
        return self.by_num[ref.num]


def _exc_name(exc):
    """The nearest builtin exception class of ``exc`` (the runner raises a fresh one of it)."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "builtins":
            return cls.__name__
    return "Exception"


def _error(exc):
    try:
        message = str(exc)[:500]
    except BaseException:
        message = "<unprintable>"
    return ("err", _exc_name(exc), message)


def load(source):
    """Run the program as module ``solution``; the first message it sends."""
    import sys
    import types

    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    try:
        exec(compile(source, "solution.py", "exec"), module.__dict__)
    except BaseException as exc:  # SystemExit too: the program did not load
        return module, _error(exc)[1:]
    names = []
    for name, value in list(module.__dict__.items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        if isinstance(value, type):
            names.append((name, "class", None))
        elif callable(value):
            names.append((name, "func", None))
        else:
            names.append((name, "value", value))
    return module, names


def serve(sock, source):
    objects = _Objects()
    module, names = load(source)
    if isinstance(names, tuple):
        wire.send_message(sock, ("load_error", *names))
        return
    wire.send_message(sock, ("ready", names), objects.ref_of)
    while True:
        try:
            request = wire.recv_message(sock)
        except wire.WireError:
            return  # the runner is done (or closed the channel): nothing more to answer
        try:
            answer = _answer(request, module, objects)
        except BaseException as exc:
            answer = _error(exc)
        try:
            wire.send_message(sock, answer, objects.ref_of)
        except wire.WireError as exc:
            wire.send_message(sock, ("err", "ValueError", f"result cannot cross: {exc}"))


def _answer(request, module, objects):
    kind = request[0]
    if kind == "call":
        _, obj, attr, args, kwargs = request
        target = getattr(module, obj) if isinstance(obj, str) else objects.get(obj)
        fn = target if attr is None else getattr(target, attr)
        args = [objects.get(a) if type(a) is wire.Ref else a for a in args]
        kwargs = {k: objects.get(v) if type(v) is wire.Ref else v for k, v in kwargs.items()}
        result = fn(*args, **kwargs)
        writeback = [a if isinstance(a, _MUTABLE) else None for a in args]
        return ("ok", result, writeback)
    if kind == "getattr":
        value = getattr(objects.get(request[1]), request[2])
        return ("method",) if callable(value) and not isinstance(value, type) else ("ok", value, [])
    if kind == "op":
        _, ref, op, args = request
        return ("ok", _OPS[op](objects.get(ref), *args), [])
    raise ValueError(f"unknown request {kind!r}")
