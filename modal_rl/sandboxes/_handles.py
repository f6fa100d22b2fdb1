"""The runner's stand-ins for the program's objects (stdlib only).

A program object that is not a value stays in the program; the test holds a stand-in here whose
protocol follows what the object is (the program's claim, which only chooses the questions the
runner may ask, never an answer):
- ``call`` (a function, method, closure): calling it;
- ``iter`` (an iterator, a generator): ``next`` and iteration, fetched in growing batches;
- ``await`` (a coroutine): a real coroutine here, so ``asyncio.run`` and ``await`` work;
- ``class:<name>`` and ``obj:<name>``: the whole object protocol (attributes, methods, operators,
  comparisons, items, ``len``, ``bool``, iteration, ``with``, ``repr``), when the class is one
  the test names (bound by declaration) or the object was reached through such an object;
  otherwise the object is **opaque**: the test can hand it back to the program, print it and
  compare it by identity, and nothing else. So a function cannot hand the test an object of its
  own that answers the test's questions (``greet('Bob').startswith(...)``), while a test that
  builds and drives the program's classes gets Python's meaning.
A program object never equals a value of the test's: ``==`` between two program objects asks the
program (the test's verdict then rests on the program's own method: counted, ``Channel.decides``).
Exceptions keep their meaning: a program exception is raised here as a class of the same name and
builtin base (one class per name), with the program's message and args.
"""

import builtins

_CONTROL = ("StopIteration", "StopAsyncIteration", "GeneratorExit", "SystemExit", "KeyboardInterrupt")
_DECIDES = ("eq", "ne", "lt", "le", "gt", "ge", "bool", "contains")


class Handles:
    """The stand-ins of one run: classes made per name, exception types per name."""

    def __init__(self, channel, exported):
        self.channel = channel
        self.exported = set(exported)  # program class names the test binds
        self.classes = {}
        self.bare = {}
        self.exceptions = {}

    def exception_type(self, name, base):
        cls = getattr(builtins, base, None)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            cls = Exception
        if name == cls.__name__:
            return cls
        key = (name, cls)
        if key not in self.exceptions:
            self.exceptions[key] = type(name, (cls,), {"__module__": "solution"})
        return self.exceptions[key]

    def error(self, reply):
        """The exception a program's ``("err", ...)`` answer raises here."""
        name = reply[1] if len(reply) > 1 and type(reply[1]) is str else "Exception"
        base = reply[2] if len(reply) > 2 and type(reply[2]) is str else "Exception"
        message = reply[3] if len(reply) > 3 and type(reply[3]) is str else ""
        args = reply[4] if len(reply) > 4 and type(reply[4]) is tuple else (message,)
        if name in _CONTROL or base in _CONTROL:
            # PEP 479's rule: control flow raised by a call is a failed call, never control flow
            return RuntimeError(f"the program raised {name}" + (f": {message}" if message else ""))
        cls = self.exception_type(name, base)
        try:
            exc = cls(*args)
        except Exception:
            exc = cls(message)
        return exc

    def class_for(self, name, num):
        key = (name, num)
        if key not in self.classes:
            # its instance methods are real functions of the stand-in class, so a test's
            # subclass can override them and reach the program's through ``super()``
            methods = self.channel.op(num, "methods", [], want=list)
            body = {m: _method(m) for m in methods if type(m) is str and m.isidentifier()}
            self.classes[key] = RemoteClass(name, (RemoteObject,), {"__module__": "solution", **body})
            type.__setattr__(self.classes[key], "_mrl", (self, num))
        return self.classes[key]

    def make(self, ref, trusted=False):
        """The stand-in of reference ``ref`` (``trusted``: reached through a named object)."""
        kind = ref.kind
        if kind == "call":
            return RemoteCallable(self, ref.num)
        if kind == "iter":
            return RemoteIterator(self, ref.num)
        if kind == "await":
            return _coroutine(self, ref.num)
        if kind.startswith("class:"):
            name = kind[6:]
            return (
                self.class_for(name, ref.num) if name in self.exported or trusted else Opaque(self, ref.num)
            )
        name = kind[4:] if kind.startswith("obj:") else ""
        if name in self.exported or trusted:
            obj = RemoteObject.__new__(self.class_for_instance(name))
            object.__setattr__(obj, "_mrl", (self, ref.num))
            return obj
        return Opaque(self, ref.num)

    def class_for_instance(self, name):
        """The stand-in class of the program's class ``name`` (a bare one if the test never
        touched the class itself: its instances still speak the whole protocol)."""
        for (cls_name, _), cls in self.classes.items():
            if cls_name == name:
                return cls
        if name not in self.bare:
            self.bare[name] = RemoteClass(name, (RemoteObject,), {"__module__": "solution"})
        return self.bare[name]


def _method(name):
    def method(self, *args, **kwargs):
        h, num = object.__getattribute__(self, "_mrl")
        return h.channel.call(num, name, args, kwargs, trusted=True)

    method.__name__ = method.__qualname__ = name
    return method


class RemoteCallable:
    def __init__(self, handles, num):
        self._h, self._num = handles, num

    def __call__(self, *args, **kwargs):
        return self._h.channel.call(self._num, None, args, kwargs)

    def __repr__(self):
        return f"<program function #{self._num}>"


class RemoteIterator:
    """An iterator of the program's: ``next`` asks for one item; iteration for growing batches."""

    def __init__(self, handles, num):
        self._h, self._num, self._batch, self._done = handles, num, [], False
        self._size = 1

    def __iter__(self):
        return self

    def __next__(self):
        if not self._batch:
            if self._done:
                raise StopIteration
            items, done = self._h.channel.op(self._num, "next_n", [self._size], trusted=False)
            if type(items) is not list:
                raise TypeError("the program's iterator answered out of protocol")
            self._batch, self._done = items[::-1], done is True
            self._size = min(self._size * 4, 4096)
            if not self._batch:
                self._done = True
                raise StopIteration
        return self._batch.pop()

    def send(self, value):
        return self._h.channel.call(self._num, "send", (value,), {})

    def close(self):
        return self._h.channel.call(self._num, "close", (), {})

    def __repr__(self):
        return f"<program iterator #{self._num}>"


def _coroutine(handles, num):
    async def awaited():
        return handles.channel.op(num, "await", [], trusted=False)

    return awaited()


class Opaque:
    """A program object of a class the test does not name: it can only go back to the program."""

    def __init__(self, handles, num):
        self._h, self._num = handles, num

    def __repr__(self):
        return self._h.channel.op(self._num, "repr", [], trusted=False, want=str)

    def __str__(self):
        return self._h.channel.op(self._num, "str", [], trusted=False, want=str)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise TypeError(f"the program returned an object of a class the test does not name ({name!r} asked)")


class RemoteClass(type):
    """A program class the test names: calling it constructs in the program; its attributes
    (class constants, classmethods, staticmethods) are the program's."""

    def __call__(cls, *args, **kwargs):
        handles, num = type.__getattribute__(cls, "_mrl")
        obj = handles.channel.call(num, None, args, kwargs, trusted=True)
        if isinstance(obj, RemoteObject) and type(obj) is not cls:
            promoted = RemoteObject.__new__(cls)
            object.__setattr__(promoted, "_mrl", object.__getattribute__(obj, "_mrl"))
            return promoted
        return obj

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        handles, num = type.__getattribute__(cls, "_mrl")
        return handles.channel.attribute(num, name)

    def __repr__(cls):
        return f"<program class {cls.__name__}>"


def _binary(op, reflected=False):
    def method(self, other):
        h, num = object.__getattribute__(self, "_mrl")
        if op in ("eq", "ne") and not isinstance(other, RemoteObject):
            return NotImplemented  # a program object never equals a value of the test's
        same = isinstance(other, RemoteObject) and object.__getattribute__(other, "_mrl")[1] == num
        if same and op in ("eq", "ne"):
            return op == "eq"
        return h.channel.op(num, ("r" + op) if reflected else op, [other], decides=op in _DECIDES)

    return method


def _unary(op, want=None):
    def method(self, *args):
        h, num = object.__getattribute__(self, "_mrl")
        return h.channel.op(num, op, list(args), decides=op in _DECIDES, want=want)

    return method


class RemoteObject:
    """An object of a program class the test names: the whole object protocol, each use a request."""

    __slots__ = ("_mrl",)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        h, num = object.__getattribute__(self, "_mrl")
        return h.channel.attribute(num, name)

    def __setattr__(self, name, value):
        h, num = object.__getattribute__(self, "_mrl")
        h.channel.op(num, "setattr", [name, value])

    def __delattr__(self, name):
        h, num = object.__getattribute__(self, "_mrl")
        h.channel.op(num, "delattr", [name])

    def __call__(self, *args, **kwargs):
        h, num = object.__getattribute__(self, "_mrl")
        return h.channel.call(num, None, args, kwargs, trusted=True)

    def __hash__(self):
        h, num = object.__getattribute__(self, "_mrl")
        value = h.channel.op(num, "hash", [], want=int)
        return value

    def __iter__(self):
        h, num = object.__getattribute__(self, "_mrl")
        it = h.channel.op(num, "iter", [])
        return it if isinstance(it, RemoteIterator) else iter(it)

    def __enter__(self):
        h, num = object.__getattribute__(self, "_mrl")
        return h.channel.op(num, "enter", [])

    def __exit__(self, cls, exc, tb):
        h, num = object.__getattribute__(self, "_mrl")
        args = [None, None] if exc is None else [type(exc).__name__, str(exc)]
        return bool(h.channel.op(num, "exit", args))

    def __await__(self):
        h, num = object.__getattribute__(self, "_mrl")
        return _coroutine(h, num).__await__()

    def __repr__(self):
        h, num = object.__getattribute__(self, "_mrl")
        return h.channel.op(num, "repr", [], want=str)

    def __str__(self):
        h, num = object.__getattribute__(self, "_mrl")
        return h.channel.op(num, "str", [], want=str)

    __len__ = _unary("len", want=int)
    __bool__ = _unary("bool", want=bool)
    __next__ = _unary("next")
    __getitem__ = _unary("getitem")
    __setitem__ = _unary("setitem")
    __delitem__ = _unary("delitem")
    __contains__ = _unary("contains", want=bool)
    __neg__, __pos__ = _unary("neg"), _unary("pos")
    __abs__, __invert__ = _unary("abs"), _unary("invert")
    __int__, __float__, __index__ = (
        _unary("int", want=int),
        _unary("float", want=float),
        _unary("index", want=int),
    )


for _op in ("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow"):
    setattr(RemoteObject, f"__{_op}__", _binary(_op))
for _op in ("matmul", "and", "or", "xor", "lshift", "rshift"):
    setattr(RemoteObject, f"__{_op}__", _binary(_op))
for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor"):
    setattr(RemoteObject, f"__r{_op}__", _binary(_op, reflected=True))
