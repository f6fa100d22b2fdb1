"""The program's side of a test run: the model's code as a module that answers calls (stdlib only).

Runs in the program process that ``_runner`` starts, isolated from it, and holds nothing but its
end of one socket and a copy of stderr. Nothing here is trusted: the program can replace any of
it, so the runner treats every byte it gets as an adversary's (``_plainwire.Decoder``).

Protocol (each message one ``_plainwire`` value):
- first, from here: ``("ready", [(name, kind), ...])`` for the program's top-level functions
  (``"func"``), classes (``"class"``), exception classes (``"exc:<builtin base>"``) and values
  (``"value"``, their value fetched on use); or ``("load_error", type, message)``;
- then requests from the runner, one at a time, each answered once: ``("call", target, attr,
  args, kwargs)``, ``target`` a top-level name or a reference, ``attr`` a method name or None;
  ``("op", ref, op, args)`` for the object protocol (``OPS``), and ``("get", name)`` for a
  top-level value. Answers: ``("ok", value, new_args, new_kwargs)`` (the arguments' contents
  after the call, so in-place changes reach the test), ``("stop", value)`` (an iterator is
  exhausted), ``("err", class name, builtin base, message, args)``;
- while answering, the program may ask the runner: ``("rcall", ref, attr, args, kwargs)`` (a
  callable the test passed in), ``("input", prompt)``, ``("stdin", method, args)``; and tell
  it ``("write", stream, text)`` and ``("warn", class name, builtin base, message)``.
A value that is not a value (``_plainwire``) stays here and travels as a reference whose kind
says what it is: ``call``, ``iter``, ``await``, ``class:<name>`` or ``obj:<class name>``.
"""

import builtins
import collections.abc
import operator
import sys
import types
import warnings

try:  # on the host (tests); in the sandbox the runner script provides the module
    from modal_rl.sandboxes import _plainwire as wire
except ImportError:
    import _plainwire as wire

OPS = {
    "len": len,
    "bool": bool,
    "str": str,
    "repr": repr,
    "hash": hash,
    "iter": iter,
    "getitem": operator.getitem,
    "setitem": operator.setitem,
    "delitem": operator.delitem,
    "contains": operator.contains,
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": abs,
    "invert": operator.invert,
    "int": int,
    "float": float,
    "index": operator.index,
    "getattr": getattr,
    "setattr": setattr,
    "delattr": delattr,
    "call": lambda obj, *args: obj(*args),
    "methods": lambda cls: sorted(
        n for n in dir(cls) if not n.startswith("__") and isinstance(_static(cls, n), types.FunctionType)
    ),
}
BINARY = ("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod")
BINARY += ("pow", "matmul", "and", "or", "xor", "lshift", "rshift")
_MUTABLE = (list, dict, set, bytearray, collections.deque)
_FLUSH_AT = 64 << 10


def _static(cls, name):
    """``name`` as defined on ``cls`` or a base (no descriptor run): a plain function is a method."""
    for klass in getattr(cls, "__mro__", ()):
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _builtin_base(cls):
    for base in cls.__mro__:
        if base.__module__ == "builtins":
            return base.__name__
    return "Exception"


def _kind_of(value):
    if isinstance(value, type):
        if issubclass(value, BaseException):
            return f"exc:{_builtin_base(value)}"
        return "class"
    return "func" if callable(value) else "value"


class Program:
    """The program's module and the objects the runner holds references to, by number."""

    def __init__(self, sock):
        self.sock = sock
        self.by_num, self.num_of = {}, {}
        self.value_classes = set()  # class names the tests define (instances travel by value)
        self.module = types.ModuleType("solution")
        self.synthetic = {}
        self.out = []
        self.out_size = 0
        self.reader = wire.Reader(sock)

    # references -----------------------------------------------------------------------------
    def ref_of(self, obj):
        num = self.num_of.get(id(obj))
        if num is None:
            num = len(self.by_num) + 1
            self.by_num[num], self.num_of[id(obj)] = obj, num
        return wire.Ref(num, self._ref_kind(obj))

    @staticmethod
    def _ref_kind(obj):
        if isinstance(obj, type):
            return f"class:{obj.__name__}"
        if isinstance(obj, types.CoroutineType) or hasattr(type(obj), "__await__"):
            return "await"
        if isinstance(obj, collections.abc.Iterator):
            return "iter"
        if isinstance(obj, types.FunctionType | types.MethodType | types.BuiltinFunctionType):
            return "call"
        return f"obj:{type(obj).__name__}"

    def by_value(self, obj):
        name = type(obj).__name__
        return name if name in self.value_classes else None

    def new_class(self, name):
        if name not in self.value_classes:
            return None
        if name not in self.synthetic:
            self.synthetic[name] = type(name, (), {"__module__": "solution"})
        return self.synthetic[name]

    def make_ref(self, ref):
        if ref.runner:
            return RunnerObject(self, ref)
        if ref.num not in self.by_num:
            raise wire.ValueWireError("reference to an unknown object")
        return self.by_num[ref.num]

    # messages -------------------------------------------------------------------------------
    def send(self, value, origins=None):
        self.flush()
        data = wire.Encoder(self.by_value, self.ref_of, origins).encode(value)
        self.sock.sendall(wire._LEN.pack(len(data)) + data)

    def _send_plain(self, value):
        data = wire.encode(value)
        self.sock.sendall(wire._LEN.pack(len(data)) + data)

    def receive(self):
        data = self.reader.message()
        decoder = wire.Decoder(_ProgramClasses(self), self.new_class, self.make_ref)
        return decoder.decode(data), decoder

    def write(self, stream, text):
        self.out.append((stream, text))
        self.out_size += len(text)
        if self.out_size >= _FLUSH_AT:
            self.flush()

    def flush(self):
        if not self.out:
            return
        pending, self.out, self.out_size = self.out, [], 0
        for stream, text in pending:
            self._send_plain(("write", stream, text))

    def ask_runner(self, request):
        """A request to the runner; serves the runner's nested requests until it answers."""
        self.send(request)
        while True:
            message, decoder = self.receive()
            if type(message) is tuple and message and message[0] in ("ok", "err"):
                if message[0] == "err":
                    raise _rebuilt_error(message)
                return message[1]
            self.answer(message, decoder)

    # serving --------------------------------------------------------------------------------
    def answer(self, request, decoder):
        # an object the runner sent comes back as the number it had in the request (its position)
        origins = {id(obj): i for i, (obj, _) in enumerate(decoder.received, 1)}
        try:
            reply = self._answer(request)
        except StopIteration as exc:
            reply = ("stop", exc.value) if _is_op(request, "next") else _error(exc)
        except BaseException as exc:
            reply = _error(exc)
        try:
            self.send(reply, (lambda obj: origins.get(id(obj), 0)) if origins else None)
        except (wire.ValueWireError, RecursionError, MemoryError) as exc:
            self.send(("err", "ValueError", "ValueError", f"result cannot cross: {exc}", None))

    def _answer(self, request):
        kind = request[0]
        if kind == "call":
            _, target, attr, args, kwargs = request
            obj = getattr(self.module, target) if type(target) is str else target
            fn = obj if attr is None else getattr(obj, attr)
            result = fn(*args, **kwargs)
            new_args = [a if isinstance(a, _MUTABLE) or self.by_value(a) else None for a in args]
            new_kwargs = {k: v for k, v in kwargs.items() if isinstance(v, _MUTABLE) or self.by_value(v)}
            return ("ok", result, new_args, new_kwargs)
        if kind == "get":
            return ("ok", getattr(self.module, request[1]), None, None)
        if kind == "op":
            _, obj, op, args = request
            return ("ok", _op(obj, op, args), None, None)
        raise ValueError(f"unknown request {kind!r}")

    def serve(self, source, prelude):
        names = self.load(source, prelude)
        if type(names) is tuple:
            self._send_plain(("load_error", *names))
            return
        self._send_plain(("ready", names))
        while True:
            try:
                request, decoder = self.receive()
            except (wire.ValueWireError, OSError):
                return  # the runner is done (or closed the channel): nothing more to answer
            if type(request) is tuple and len(request) == 2 and request[0] == "setup":
                self.value_classes = set(request[1]) if type(request[1]) is list else set()
                continue
            self.answer(request, decoder)

    def load(self, source, prelude):
        """Run the prelude, then the program, as module ``solution``; its names and kinds."""
        module = self.module
        module.__file__ = "solution.py"
        sys.modules["solution"] = module
        _redirect(self)
        try:
            if prelude:
                exec(compile(prelude, "<prelude>", "exec"), module.__dict__)
            exec(compile(source, "solution.py", "exec"), module.__dict__)
        except BaseException as exc:  # SystemExit too: the program did not load
            return _error(exc)[1], _error(exc)[3]
        return [
            (name, _kind_of(value))
            for name, value in list(vars(module).items())
            if type(name) is str and not name.startswith("__") and not isinstance(value, types.ModuleType)
        ]


def _is_op(request, op):
    return type(request) is tuple and len(request) > 2 and request[0] == "op" and request[2] == op


def _op(obj, op, args):
    if op == "next":
        return next(obj)
    if op == "next_n":  # a batch for iteration: [items], done
        items = []
        for _ in range(min(int(args[0]), 65536)):
            try:
                items.append(next(obj))
            except StopIteration:
                return [items, True]
        return [items, False]
    if op == "await":
        import asyncio

        return asyncio.new_event_loop().run_until_complete(_awaited(obj))
    if op == "enter":
        return type(obj).__enter__(obj)
    if op == "exit":
        exc = None
        if args and args[0] is not None:
            cls = getattr(builtins, args[0], None)
            exc = (cls if isinstance(cls, type) and issubclass(cls, BaseException) else Exception)(args[1])
        return type(obj).__exit__(obj, type(exc) if exc else None, exc, None)
    if op in BINARY or (op.startswith("r") and op[1:] in BINARY):
        name = op[1:] if op.startswith("r") and op[1:] in BINARY else op
        fn = getattr(operator, name + "_" if name in ("and", "or") else name)
        return fn(args[0], obj) if name != op else fn(obj, args[0])
    return OPS[op](obj, *args)


async def _awaited(obj):
    return await obj


def _error(exc):
    try:
        message = str(exc)[:65536]
    except BaseException:
        message = "<unprintable>"
    try:
        wire.encode(exc.args)
        args = exc.args
    except BaseException:
        args = None
    return ("err", type(exc).__name__, _builtin_base(type(exc)), message, args)


def _rebuilt_error(message):
    cls = getattr(builtins, message[2] if len(message) > 2 else "", None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        cls = Exception
    return cls(message[3] if len(message) > 3 else "")


class _ProgramClasses:
    """The program's classes by name, looked up only when an object by value arrives."""

    def __init__(self, program):
        self._program = program

    def get(self, name, default=None):
        found = vars(self._program.module).get(name)
        if isinstance(found, type):
            return found
        return self._program.synthetic.get(name, default)


class RunnerObject:
    """An object the test passed in (a callback): every use is a request to the runner."""

    def __init__(self, program, ref):
        self._program, self._ref = program, ref

    def __call__(self, *args, **kwargs):
        return self._program.ask_runner(("rcall", self._ref, None, list(args), dict(kwargs)))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: self._program.ask_runner(("rcall", self._ref, name, list(a), dict(k)))

    def __iter__(self):
        return self

    def __next__(self):
        return self._program.ask_runner(("rcall", self._ref, "__next__", [], {}))

    def __repr__(self):
        return f"<test object {self._ref.kind}>"


class _Out:
    """The program's stdout/stderr: what it prints reaches the test's streams (capsys)."""

    def __init__(self, program, stream):
        self._program, self._stream = program, stream

    def write(self, text):
        text = str(text)
        self._program.write(self._stream, text)
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


class _In:
    """The program's stdin: reads are the test's (``sys.stdin`` as the test set it)."""

    def __init__(self, program):
        self._program = program

    def _ask(self, method, *args):
        return self._program.ask_runner(("stdin", method, list(args)))

    def read(self, n=-1):
        return self._ask("read", n)

    def readline(self, n=-1):
        return self._ask("readline", n)

    def readlines(self):
        return self._ask("readlines")

    def __iter__(self):
        return iter(self.readline, "")


def _redirect(program):
    sys.stdout, sys.stderr = _Out(program, "stdout"), _Out(program, "stderr")
    sys.stdin = _In(program)

    def _input(prompt=""):
        return program.ask_runner(("input", str(prompt)))

    def _showwarning(message, category, filename, lineno, file=None, line=None):
        program.flush()
        text = str(message)[:65536]
        program._send_plain(("warn", category.__name__, _builtin_base(category), text))

    builtins.input = _input
    warnings.showwarning = _showwarning
    warnings.simplefilter("always")


def serve(sock, source, prelude=None):
    Program(sock).serve(source, prelude)
