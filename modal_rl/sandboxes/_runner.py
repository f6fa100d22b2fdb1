"""The trusted test runner: the dataset's tests, run as written, against the program as a remote
module (stdlib only; ``testrun.runner_source`` ships it into the sandbox as one script).

Order of events, and why:
1. the runner makes itself non-dumpable, keeps a private copy of its stdout for the report and
   points fd 1 at stderr (whatever a test or pytest prints can never reach the report);
2. it reads *only the program* from stdin (exact lengths, no read-ahead buffer), then forks the
   program process (``_isolation.start``): nothing of the tests is in memory when it forks;
3. only then it reads the tests, builds module ``solution`` out of remote stand-ins (every call
   an RPC, arguments and results plain data: ``_plainwire``) and runs the tests in their own form
   (``_testforms``): exec'd script, real ``unittest``, real ``pytest``;
4. it writes one line per test unit and a closing line to the private stdout (``testrun`` on the
   host parses them with bounds).
Nothing of the program's objects runs here: an object comes back as a ``RemoteObject`` whose
equality is identity and whose methods are RPCs; an exception comes back as a fresh instance of
the nearest builtin exception class, made here from its name and a truncated message.
"""

import builtins
import contextlib
import json
import os
import sys
import time

try:  # on the host (tests); in the sandbox the runner script provides the modules
    from modal_rl.sandboxes import _isolation, _testforms
    from modal_rl.sandboxes import _plainwire as wire
except ImportError:
    import _isolation
    import _plainwire as wire
    import _testforms

UNIT, NOTE, DONE, INFRA = "MODAL_RL_UNIT", "MODAL_RL_NOTE", "MODAL_RL_DONE", "MODAL_RL_INFRA"
_EXCEPTIONS = {
    name: cls for name, cls in vars(builtins).items() if isinstance(cls, type) and issubclass(cls, Exception)
}
_WHY_CHARS = 300


def clip(text, limit=_WHY_CHARS):
    text = str(text)
    return (text[:limit] + "...") if len(text) > limit else text


class ProgramGone(RuntimeError):
    """The program died, hung past the time limit or broke the protocol: its calls fail."""


class Channel:
    """The runner's end of the program's socket; every answer is checked before it is used."""

    def __init__(self, sock, stop, deadline):
        self.sock, self._stop, self.deadline, self.gone = sock, stop, deadline, None
        self.refs = 0  # references in the last answer (only a construction may return one)

    def _ref(self, num):
        self.refs += 1
        return RemoteObject(self, num)

    def stop(self, why):
        if self.gone is None:
            self.gone = why
            self._stop()

    def receive(self):
        self.sock.settimeout(max(0.001, self.deadline - time.monotonic()))
        try:
            self.refs = 0
            return wire.recv_message(self.sock, self._ref)
        except TimeoutError:
            self.stop("the program did not answer before the time limit")
        except (wire.WireError, OSError) as exc:
            self.stop(f"the program's channel failed: {clip(exc, 120)}")
        raise ProgramGone(self.gone)

    def ask(self, request):
        if self.gone is not None:
            raise ProgramGone(self.gone)
        try:
            self.sock.settimeout(max(0.001, self.deadline - time.monotonic()))
            wire.send_message(self.sock, request, lambda v: v.num if type(v) is RemoteObject else None)
        except wire.WireError as exc:
            raise TypeError(f"only plain data can be passed to the program: {exc}") from None
        except OSError as exc:
            self.stop(f"the program's channel failed: {clip(exc, 120)}")
            raise ProgramGone(self.gone) from None
        try:
            reply = self.receive()
        except BaseException:  # interrupted mid-answer (the time limit): the stream is unusable
            self.stop("the call was interrupted")
            raise
        if type(reply) is not tuple or not reply or reply[0] not in ("ok", "method", "err"):
            self.stop("the program answered out of protocol")
            raise ProgramGone(self.gone)
        if reply[0] == "err":
            name = reply[1] if len(reply) == 3 and type(reply[1]) is str else "Exception"
            message = reply[2] if len(reply) == 3 and type(reply[2]) is str else ""
            cls = _EXCEPTIONS.get(name, RuntimeError)
            raise cls(f"(from the program) {clip(message)}")
        return reply


def _write_back(args, writeback):
    """The program's new contents of the mutable arguments it was passed (copied back in place)."""
    if type(writeback) is not list:
        return
    for arg, new in zip(args, writeback, strict=False):
        if type(arg) is not type(new) or type(arg) not in (list, dict, set):
            continue
        arg.clear()
        arg.update(new) if type(arg) is not list else arg.extend(new)


def _call(channel, obj, attr, args, kwargs, construct=False):
    """One call into the program. Only constructing one of its classes (``construct``) returns an
    object of the program's (a ``RemoteObject``); every other call must answer plain data, so a
    function cannot hand the test an object that answers the test's questions itself."""
    args = list(args)
    reply = channel.ask(("call", obj, attr, args, dict(kwargs)))
    if reply[0] != "ok" or len(reply) != 3:
        channel.stop("the program answered out of protocol")
        raise ProgramGone(channel.gone)
    result = reply[1]
    if channel.refs and not (construct and channel.refs == 1 and type(result) is RemoteObject):
        raise TypeError("the program returned an object where plain data was expected")
    _write_back(args, reply[2])
    return result


class RemoteFunction:
    """A top-level callable (function or class) of the program."""

    def __init__(self, channel, name, is_class=False):
        self._channel, self.__name__, self.__qualname__ = channel, name, name
        self._is_class = is_class

    def __call__(self, *args, **kwargs):
        return _call(self._channel, self.__name__, None, args, kwargs, construct=self._is_class)

    def __repr__(self):
        return f"<remote {self.__name__}>"


class RemoteObject:
    """An object that lives in the program. Equality and hashing are identity (the program's own
    ``__eq__`` never decides a comparison); attributes, calls and a few builtins are RPCs."""

    def __init__(self, channel, num):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_num", num)

    @property
    def num(self):
        return self._num

    def _op(self, op, *args):
        reply = self._channel.ask(("op", wire.Ref(self._num), op, list(args)))
        if reply[0] != "ok" or len(reply) != 3 or self._channel.refs:
            raise TypeError(f"the program's {op}() did not answer plain data")
        return reply[1]

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        reply = self._channel.ask(("getattr", wire.Ref(self._num), name))
        if reply[0] == "method":
            return lambda *a, **k: _call(self._channel, wire.Ref(self._num), name, a, k)
        if len(reply) != 3 or self._channel.refs:
            raise TypeError(f"the program's attribute {name!r} is not plain data")
        return reply[1]

    def __len__(self):
        n = self._op("len")
        if type(n) is not int or n < 0:
            raise TypeError("the program's len() is not a non-negative int")
        return n

    def __bool__(self):
        b = self._op("bool")
        if type(b) is not bool:
            raise TypeError("the program's bool() is not a bool")
        return b

    def __str__(self):
        s = self._op("str")
        if type(s) is not str:
            raise TypeError("the program's str() is not a str")
        return s

    def __iter__(self):
        items = self._op("list")
        if type(items) is not list:
            raise TypeError("the program's object cannot be iterated")
        return iter(items)

    def __getitem__(self, key):
        return self._op("getitem", key)

    def __contains__(self, item):
        return self._op("contains", item) is True

    def __repr__(self):
        return f"<remote object #{self._num}>"


def build_module(channel, names):
    """Module ``solution``: the program's names as remote stand-ins and plain values."""
    import types

    module = types.ModuleType("solution")
    public = []
    for entry in names if type(names) is list else []:
        if type(entry) is not tuple or len(entry) != 3 or type(entry[0]) is not str:
            continue
        name, kind, value = entry
        if kind in ("func", "class"):
            setattr(module, name, RemoteFunction(channel, name, is_class=kind == "class"))
        elif kind == "value":
            setattr(module, name, value)
        else:
            continue
        public.append(name)
    module.__all__ = [n for n in public if not n.startswith("_")]
    return module


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


def main():
    _isolation.make_undumpable()
    report = os.dup(1)
    os.dup2(2, 1)  # every print of a test or of pytest goes to stderr, never to the report
    size = int.from_bytes(_read_exact(4), "big")
    source = _read_exact(size).decode("utf-8", "surrogatepass")
    started = time.monotonic()
    try:
        pid, sock = _isolation.start(source, keep_fd=2, close_fds=(report,))
    except _isolation.IsolationError as exc:
        _line(report, INFRA, clip(exc))
        os._exit(0)
    spec = json.loads(_read_rest())
    deadline = started + float(spec["deadline_s"])
    channel = Channel(sock, lambda: _isolation.stop(pid), deadline)
    try:
        hello = channel.receive()
    except ProgramGone:
        hello = None  # it died or hung while loading
    units = []
    try:
        if type(hello) is tuple and hello[:1] == ("ready",) and len(hello) == 2:
            module = build_module(channel, hello[1])
            sys.modules["solution"] = module
            units = _testforms.run(spec, module, deadline, channel)
        else:
            why = "the program did not load"
            if type(hello) is tuple and len(hello) == 3 and hello[0] == "load_error":
                why = f"the program did not load: {clip(hello[1], 60)}: {clip(hello[2])}"
            _line(report, NOTE, why)
            units = _testforms.failed_units(spec, "the program did not load")
    except _testforms.TestFormUnavailable as exc:
        _line(report, INFRA, clip(exc))
        os._exit(0)
    finally:
        _testforms.disarm()
        channel.stop("the tests are done")
        with contextlib.suppress(OSError):
            sock.close()
    for name, ok, why in units:
        _line(report, UNIT, "1" if ok else "0", clip(name, 200), clip(why))
    _line(report, DONE, str(len(units)))
    os._exit(0)


if __name__ == "__main__":
    main()
