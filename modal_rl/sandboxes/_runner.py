"""The trusted test runner: the dataset's tests, run as written, against the program as a remote
module (stdlib only; ``testrun.runner_source`` ships it into the sandbox as one script).

Order of events, and why:
1. the runner makes itself non-dumpable, keeps a private copy of its stdout for the report and
   points fd 1 at stderr (whatever a test or pytest prints can never reach the report);
2. it reads *only the program and the dataset's prelude* from stdin (exact lengths, no
   read-ahead buffer), then forks the program process (``_isolation.start``): nothing of the
   tests is in memory when it forks;
3. only then it reads the tests, builds module ``solution`` out of remote stand-ins
   (``_handles``; values cross by value, ``_plainwire``) and runs the tests in their own form
   (``_testforms``): exec'd script, real ``unittest``, real ``pytest``;
4. it writes one line per test unit as soon as the unit is decided, and a closing line, to the
   private stdout (``testrun`` on the host parses them with bounds; a run cut short keeps every
   unit it decided).
Nothing of the program's objects runs here: an object comes back as a stand-in whose every use
is a request, and the program's answers are values rebuilt with the runner's own classes.
"""

import builtins
import contextlib
import json
import os
import sys
import time
import warnings

try:  # on the host (tests); in the sandbox the runner script provides the modules
    from modal_rl.sandboxes import _handles, _isolation, _testforms
    from modal_rl.sandboxes import _plainwire as wire
except ImportError:
    import _handles
    import _isolation
    import _plainwire as wire
    import _testforms

UNIT, NOTE, DONE, INFRA = "MODAL_RL_UNIT", "MODAL_RL_NOTE", "MODAL_RL_DONE", "MODAL_RL_INFRA"
TOTAL, DECIDES, BAD = "MODAL_RL_TOTAL", "MODAL_RL_DECIDES", "MODAL_RL_BADTESTS"
_WHY_CHARS = 300
_FORWARD_LIMIT = 4 << 20  # bytes of the program's prints the runner passes on to the test
_STANDINS = (_handles.RemoteObject, _handles.Opaque, _handles.RemoteCallable, _handles.RemoteIterator)


def clip(text, limit=_WHY_CHARS):
    text = str(text)
    return (text[:limit] + "...") if len(text) > limit else text


class ProgramGone(RuntimeError):
    """The program died, hung past the time limit or broke the protocol: its calls fail."""


class Channel:
    """The runner's end of the program's socket; every answer is checked before it is used."""

    def __init__(self, sock, stop, deadline):
        self.sock, self._stop, self.deadline, self.gone = sock, stop, deadline, None
        self.handles = _handles.Handles(self, ())
        self.class_lookup = lambda name: None  # the test's class of a name (objects by value)
        self.value_class_names = set()
        self.own, self.own_num = {}, {}  # the runner's objects the program holds (callbacks)
        self.decides = 0  # comparisons and truth values the program's own methods decided
        self.forwarded = 0
        self.reader = wire.Reader(sock)
        self._timeout_at = None  # when the socket's timeout was last set (a system call)

    def _timeout(self):
        now = time.monotonic()
        if self._timeout_at is None or now - self._timeout_at > 0.05:
            # set at most every 50 ms: a wait may then run past the deadline by that much, and
            # the test's own alarm (``_testforms.arm``) still stops it
            self.sock.settimeout(max(0.001, self.deadline - now))
            self._timeout_at = now

    def stop(self, why):
        if self.gone is None:
            self.gone = why
            self._stop()

    def _ref_of(self, obj):
        if isinstance(obj, _STANDINS):
            return wire.Ref(
                object.__getattribute__(obj, "_mrl")[1]
                if isinstance(obj, _handles.RemoteObject)
                else obj._num
            )
        num = self.own_num.get(id(obj))
        if num is None:
            num = len(self.own) + 1
            self.own[num], self.own_num[id(obj)] = obj, num
        return wire.Ref(num, "call" if callable(obj) else "obj", runner=True)

    def _by_value(self, obj):
        cls = type(obj)
        name = cls.__name__
        if name in self.value_class_names and self.class_lookup(name) is cls:
            return name
        return None

    def _decoder(self, trusted, origins):
        def make_ref(ref):
            if ref.runner:
                if ref.num not in self.own:
                    raise wire.ValueWireError("reference to an unknown runner object")
                return self.own[ref.num]
            return self.handles.make(ref, trusted)

        classes = _TestClasses(self)
        return wire.Decoder(classes, None, make_ref, origins)

    def send(self, value):
        encoder = wire.Encoder(self._by_value, self._ref_of)
        data = encoder.encode(value)
        self._timeout()
        self.sock.sendall(wire._LEN.pack(len(data)) + data)
        return encoder.sent

    def receive(self, trusted=False, origins=()):
        self._timeout()
        try:
            return self._decoder(trusted, origins).decode(self.reader.message())
        except TimeoutError:
            self.stop("the program did not answer before the time limit")
        except (wire.ValueWireError, OSError) as exc:
            self.stop(f"the program's channel failed: {clip(exc, 120)}")
        raise ProgramGone(self.gone)

    def ask(self, request, trusted=False):
        """Send ``request``; answer the program's own requests until its reply comes."""
        if self.gone is not None:
            raise ProgramGone(self.gone)
        try:
            sent = self.send(request)
        except wire.ValueWireError as exc:
            raise TypeError(f"this value cannot be passed to the program: {exc}") from None
        except OSError as exc:
            self.stop(f"the program's channel failed: {clip(exc, 120)}")
            raise ProgramGone(self.gone) from None
        try:
            while True:
                reply = self.receive(trusted, sent)
                if type(reply) is not tuple or not reply or type(reply[0]) is not str:
                    break
                if reply[0] in ("ok", "err", "stop"):
                    return reply
                if not self._serve(reply):
                    break
        except BaseException:  # interrupted mid-answer (the time limit): the stream is unusable
            self.stop("the call was interrupted")
            raise
        self.stop("the program answered out of protocol")
        raise ProgramGone(self.gone)

    def _serve(self, message):
        """The program's request or notice while a call runs; False if it is out of protocol."""
        kind = message[0]
        if kind == "write" and len(message) == 3 and type(message[2]) is str:
            if self.forwarded < _FORWARD_LIMIT:
                self.forwarded += len(message[2])
                (sys.stderr if message[1] == "stderr" else sys.stdout).write(message[2])
            return True
        if kind == "warn" and len(message) == 4 and all(type(m) is str for m in message[1:]):
            cls = self.handles.exception_type(message[1], message[2])
            warnings.warn(message[3], cls if issubclass(cls, Warning) else UserWarning, stacklevel=2)
            return True
        if kind == "input" and len(message) == 2:
            return self._reply(lambda: builtins.input(str(message[1])))
        if kind == "stdin" and len(message) == 3 and message[1] in ("read", "readline", "readlines"):
            args = message[2] if type(message[2]) is list else []
            return self._reply(lambda: getattr(sys.stdin, message[1])(*args))
        if kind == "rcall" and len(message) == 5:
            _, target, attr, args, kwargs = message
            if type(args) is not list or type(kwargs) is not dict:
                return False
            fn = target if attr is None else getattr(target, attr)
            return self._reply(lambda: fn(*args, **kwargs))
        return False

    def _reply(self, work):
        try:
            answer = ("ok", work(), None, None)
        except _testforms.Deadline:
            raise
        except BaseException as exc:
            answer = ("err", type(exc).__name__, _base_name(type(exc)), clip(exc, 65536), None)
        try:
            self.send(answer)
        except wire.ValueWireError as exc:
            self.send(
                ("err", "TypeError", "TypeError", f"this value cannot be passed to the program: {exc}", None)
            )
        return True

    def _checked(self, reply, want=None):
        if reply[0] == "err":
            raise self.handles.error(reply)
        if reply[0] == "stop":
            raise StopIteration(reply[1] if len(reply) > 1 else None)
        if len(reply) != 4:
            self.stop("the program answered out of protocol")
            raise ProgramGone(self.gone)
        if want is not None and type(reply[1]) is not want:
            raise TypeError(
                f"the program answered a {type(reply[1]).__name__} where a {want.__name__} belongs"
            )
        return reply[1]

    def call(self, target, attr, args, kwargs, trusted=False):
        """Call the program's ``target`` (a top-level name or an object's number)."""
        args, kwargs = list(args), dict(kwargs)
        ref = target if type(target) is str else wire.Ref(target)
        reply = self.ask(("call", ref, attr, args, kwargs), trusted=trusted)
        result = self._checked(reply)
        _write_back(args, reply[2])
        _write_back_kw(kwargs, reply[3])
        return result

    def op(self, num, op, args, trusted=True, decides=False, want=None):
        if decides:
            self.decides += 1
        reply = self.ask(("op", wire.Ref(num), op, list(args)), trusted=trusted)
        return self._checked(reply, want)

    def attribute(self, num, name):
        """An attribute of a named object: a value, or a method (called as one more request)."""
        value = self.op(num, "getattr", [name])
        return value

    def get(self, name, trusted=False):
        reply = self.ask(("get", name), trusted=trusted)
        return self._checked(reply)


class _TestClasses:
    """The test's classes by name, for objects by value (looked up when one arrives)."""

    def __init__(self, channel):
        self._channel = channel

    def get(self, name, default=None):
        if name not in self._channel.value_class_names:
            return default
        cls = self._channel.class_lookup(name)
        return cls if isinstance(cls, type) else default


def _base_name(cls):
    for base in cls.__mro__:
        if base.__module__ == "builtins":
            return base.__name__
    return "Exception"


_REPLACEABLE = (list, dict, set, bytearray)


def _replace(arg, new):
    if type(arg) is not type(new) or type(arg) not in _REPLACEABLE or arg is new:
        return
    arg.clear()
    if type(arg) is dict or type(arg) is set:
        arg.update(new)
    else:
        arg.extend(new)


def _write_back(args, new):
    """The program's new contents of the mutable arguments it was passed, copied back in place
    (objects by value were updated in place as the answer was decoded)."""
    if type(new) is list:
        for arg, value in zip(args, new, strict=False):
            _replace(arg, value)


def _write_back_kw(kwargs, new):
    if type(new) is dict:
        for key, value in new.items():
            if key in kwargs:
                _replace(kwargs[key], value)


def _read_exact(count):
    parts = []
    while count > 0:
        chunk = os.read(0, min(count, 1 << 20))
        if not chunk:
            raise EOFError("the runner's input ended early")
        parts.append(chunk)
        count -= len(chunk)
    return b"".join(parts)


def _read_rest():
    parts = []
    while chunk := os.read(0, 1 << 20):
        parts.append(chunk)
    return b"".join(parts)


def _line(fd, *fields):
    text = "\t".join(f.replace("\t", " ").replace("\n", " ").replace("\r", " ") for f in fields)
    data = (text + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data) :]


class _Report:
    """Unit lines on the runner's private stdout, each written as soon as it is decided."""

    def __init__(self, fd):
        self.fd, self.units = fd, 0

    def emit(self, name, ok, why):
        self.units += 1
        _line(self.fd, UNIT, "1" if ok else "0", clip(name, 200), clip(why))

    def total(self, n):
        _line(self.fd, TOTAL, str(n))


def bind(channel, spec, names):
    """Module ``solution`` and the names the test sees (``_testforms.declared_names``)."""
    import ast

    tree = ast.parse(spec["tests"])
    prelude_tree = ast.parse(spec.get("prelude") or "")
    entry = spec.get("entry_point")
    program_names = (
        [(n, k) for n, k in names if type(n) is str and type(k) is str] if type(names) is list else []
    )
    declared = _testforms.declared_names(tree, prelude_tree, program_names, entry)
    channel.value_class_names = _testforms.value_class_names(tree, prelude_tree)
    channel.handles.exported = _testforms.class_names(declared)
    channel.send(("setup", sorted(channel.value_class_names)))
    kinds = dict(program_names)
    module = _testforms.SolutionModule("solution")
    module.__file__ = "solution.py"

    def standin(name):
        kind = kinds.get(name)
        if kind is None:
            raise AttributeError(f"module 'solution' has no attribute {name!r}")
        if kind.startswith("exc:"):
            return channel.handles.exception_type(name, kind[4:])
        if kind == "class" and name in channel.handles.exported:
            return channel.get(name, trusted=True)
        if kind in ("func", "class"):
            return _Function(channel, name)
        return channel.get(name)

    bound = {}
    for name in declared:
        bound[name] = standin(name)
        setattr(module, name, bound[name])
    module.__all__ = sorted(n for n, k in declared.items() if k != "value")
    module.__dict__["_mrl_get"] = standin
    if entry and entry in bound:
        bound["candidate"] = bound[entry]
    module.__dict__["_mrl_sealed"] = True
    return module, bound


def _find_class(spaces, name):
    test_module = sys.modules.get("test_task")
    for space in [*spaces, vars(test_module) if test_module else {}]:
        cls = space.get(name)
        if isinstance(cls, type):
            return cls
    return None


class _Function:
    """A top-level function of the program, called by name; what it returns is a value, or an
    object the test can use only as far as the test names its class (``_handles``)."""

    def __init__(self, channel, name):
        self._channel, self.__name__, self.__qualname__ = channel, name, name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self.__name__, None, args, kwargs)

    def __repr__(self):
        return f"<program function {self.__name__}>"


def _package_paths():
    """The packages the tests may import, read-only, after the standard library: the sandbox's
    test kit (local sandboxes) and the interpreter's own site-packages (an image's)."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = [os.path.join(prefix, "lib", version, "site-packages") for prefix in (sys.prefix, sys.exec_prefix)]
    for path in (_testforms.TESTKIT, *site):
        if path and os.path.isdir(path) and path not in sys.path:
            sys.path.append(path)


def main():
    _isolation.make_undumpable()
    _package_paths()
    report = _Report(os.dup(1))
    os.dup2(2, 1)  # every print of a test or of pytest goes to stderr, never to the report
    source = _read_exact(int.from_bytes(_read_exact(4), "big")).decode("utf-8", "surrogatepass")
    prelude = _read_exact(int.from_bytes(_read_exact(4), "big")).decode("utf-8", "surrogatepass")
    started = time.monotonic()
    try:
        pid, sock = _isolation.start(source, keep_fd=2, close_fds=(report.fd,), prelude=prelude or None)
    except _isolation.IsolationError as exc:
        _line(report.fd, INFRA, clip(exc))
        os._exit(0)
    spec = json.loads(_read_rest())
    deadline = started + float(spec["deadline_s"])
    wall = spec.get("deadline_wall")
    if type(wall) is float:  # counted from the exec's start on the host (clocks agree to ms)
        deadline = min(deadline, time.monotonic() + (wall - time.time()))
    channel = Channel(sock, lambda: _isolation.stop(pid), deadline)
    try:
        hello = channel.receive()
    except ProgramGone:
        hello = None  # it died or hung while loading
    try:
        if type(hello) is tuple and hello[:1] == ("ready",) and len(hello) == 2:
            module, bound = bind(channel, spec, hello[1])
            sys.modules["solution"] = module
            spaces = []
            channel.class_lookup = lambda name: _find_class(spaces, name)
            result = _testforms.run(spec, bound, deadline, report.emit, report.total, spaces)
            if module.__dict__.get("_mrl_patched"):
                raise _testforms.BadTests(
                    f"the tests patch the program's {module.__dict__['_mrl_patched']!r} through module "
                    "'solution', which the program never sees: patch what the program calls instead"
                )
            del result
        else:
            why = "the program did not load"
            if type(hello) is tuple and len(hello) == 3 and hello[0] == "load_error":
                why = f"the program did not load: {clip(hello[1], 60)}: {clip(hello[2])}"
            _line(report.fd, NOTE, why)
            for name, ok, unit_why in _testforms.failed_units(spec, "the program did not load"):
                report.emit(name, ok, unit_why)
    except _testforms.TestFormUnavailable as exc:
        _line(report.fd, INFRA, clip(exc))
        os._exit(0)
    except _testforms.BadTests as exc:
        _line(report.fd, BAD, clip(exc))
        os._exit(0)
    finally:
        _testforms.disarm()
        channel.stop("the tests are done")
        with contextlib.suppress(OSError):
            sock.close()
    if report.units == 0:
        _line(report.fd, BAD, "the test code has no checks: no assert, test function or test case ran")
        os._exit(0)
    _line(report.fd, DECIDES, str(channel.decides))
    _line(report.fd, DONE, str(report.units))
    os._exit(0)


if __name__ == "__main__":
    main()
