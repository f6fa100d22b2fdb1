"""The dataset's test code, run as it is written, in the runner (stdlib, and pytest when used).

``run(spec, module, deadline, channel)`` picks the form from the test code's own structure and
returns one ``(name, passed, why)`` per test unit:
- **pytest** (a top-level ``test_*`` function or ``Test*`` class, or an ``import pytest``): the
  real pytest runs the file (fixtures, classes, parametrize and all); a unit is a collected item,
  a collection error is a failed unit, an item skipped by the test's own markers is not counted,
  an item that was collected but never reported (the run was cut short) fails;
- **unittest** (a ``unittest.TestCase`` subclass): the real ``unittest`` loader and runner; a unit
  is a test method (failed subtests fail it);
- **script** (plain asserts, HumanEval's ``check(candidate)``, raise-based checks): the file runs
  as ``__main__``, one top-level statement at a time; every statement that is not a definition,
  an import or an assignment is a unit (it passes if it does not raise); a definition, import or
  assignment that raises fails every unit after it. HumanEval's ``check`` with no call of its
  own is called once with ``candidate`` (the spec's ``entry_point``).
The program's names are globals of the test (as if program and tests were one file), and
``solution`` is importable (``from solution import f``). Counts come from the test code (or
pytest's collection), never from what the program does.
"""

import ast
import os
import signal
import sys
import time

_SETUP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_SETUP += (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass, ast.Global)
TESTKIT = "/opt/modal-rl/testkit"  # where a sandbox finds pytest (testrun.testkit_binds)


class TestFormUnavailable(Exception):
    """The sandbox cannot run this test form (no pytest in its image)."""


class Deadline(BaseException):
    """The runner's own time limit: test code that runs past it is stopped."""


def _on_alarm(signum, frame):
    raise Deadline("the test ran past the time limit")


def arm(deadline):
    """Stop trusted test code that outruns the limit, then every 50 ms until the report."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, deadline - time.monotonic() + 0.5), 0.05)


def disarm():
    signal.setitimer(signal.ITIMER_REAL, 0, 0)


def describe(exc):
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:300]


def form_of(tree):
    names = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    imports = {
        a.name.split(".")[0]
        for n in tree.body
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])
    }
    if "pytest" in imports or any(
        (isinstance(n, ast.FunctionDef) and n.name.startswith("test"))
        or (isinstance(n, ast.ClassDef) and n.name.startswith("Test"))
        for n in names
    ):
        return "pytest"
    for n in names:
        if isinstance(n, ast.ClassDef) and any(ast.unparse(b).endswith("TestCase") for b in n.bases):
            return "unittest"
    return "script"


def _script_units(tree, entry_point):
    units = [s for s in tree.body if not isinstance(s, _SETUP)]
    defines_check = any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in tree.body)
    return units, bool(not units and defines_check and entry_point)


def _name(stmt):
    return f"line {stmt.lineno}: {ast.unparse(stmt).splitlines()[0][:160]}"


def failed_units(spec, why):
    """Every unit the test defines, failed (the program did not load)."""
    tree = ast.parse(spec["tests"])
    if form_of(tree) == "script":
        units, call_check = _script_units(tree, spec.get("entry_point"))
        return [(_name(s), False, why) for s in units] + (
            [("check(candidate)", False, why)] if call_check else []
        )
    return [("tests", False, why)]


def run(spec, module, deadline, channel):
    tree = ast.parse(spec["tests"])
    form = form_of(tree)
    entry = spec.get("entry_point")
    names = {n: getattr(module, n) for n in module.__all__}
    if entry and hasattr(module, entry):
        names["candidate"] = getattr(module, entry)
    arm(deadline)
    try:
        if form == "script":
            return _run_script(tree, names, entry)
        if form == "unittest":
            return _run_unittest(spec["tests"], names)
        return _run_pytest(spec["tests"], names)
    finally:
        disarm()


def _run_script(tree, names, entry):
    ns = {"__name__": "__main__", "__builtins__": __builtins__, **names}
    units, call_check = _script_units(tree, entry)
    out, setup_error = [], None
    for stmt in tree.body:
        unit = not isinstance(stmt, _SETUP)
        if setup_error is not None:
            if unit:
                out.append((_name(stmt), False, f"setup failed: {setup_error}"))
            continue
        try:
            exec(compile(ast.Module([stmt], []), "<test>", "exec"), ns)
            if unit:
                out.append((_name(stmt), True, ""))
        except BaseException as exc:  # Deadline too: this statement did not finish
            if unit:
                out.append((_name(stmt), False, describe(exc)))
            else:
                setup_error = describe(exc)
    if call_check:
        try:
            if setup_error is not None:
                raise RuntimeError(f"setup failed: {setup_error}")
            if "candidate" not in ns:
                raise NameError(f"the program defines no {entry!r}")
            ns["check"](ns["candidate"])
            out.append(("check(candidate)", True, ""))
        except BaseException as exc:
            out.append(("check(candidate)", False, describe(exc)))
    assert len(out) == len(units) + call_check
    return out


def _run_unittest(source, names):
    import types
    import unittest

    module = types.ModuleType("test_task")
    module.__dict__.update(names)
    sys.modules["test_task"] = module
    try:
        exec(compile(source, "test_task.py", "exec"), module.__dict__)
    except BaseException as exc:  # unittest.main() at top level ends in SystemExit: keep going
        if not isinstance(exc, SystemExit):
            return [("module", False, describe(exc))]
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    outcome = {}

    class Result(unittest.TestResult):
        def addSuccess(self, test):
            outcome.setdefault(test.id(), (True, ""))

        def addFailure(self, test, err):
            outcome[test.id()] = (False, describe(err[1]))

        def addError(self, test, err):
            outcome[test.id()] = (False, describe(err[1]))

        def addSkip(self, test, reason):
            outcome[test.id()] = None

        def addSubTest(self, test, subtest, err):
            if err is not None:
                outcome[test.id()] = (False, describe(err[1]))

        def addExpectedFailure(self, test, err):
            outcome[test.id()] = None

        def addUnexpectedSuccess(self, test):
            outcome[test.id()] = (False, "unexpected success")

    ids = [t.id() for t in _flatten(suite)]
    try:
        suite.run(Result())
    except BaseException as exc:  # the run was cut short: what did not report fails
        outcome.setdefault("run", (False, describe(exc)))
    units = [(i, *outcome.get(i, (False, "not run"))) for i in ids if outcome.get(i, ()) is not None]
    units += [(k, *v) for k, v in outcome.items() if k not in ids and v is not None]
    return units


def _flatten(suite):
    for t in suite:
        yield from (_flatten(t) if hasattr(t, "__iter__") else [t])


def _run_pytest(source, names):
    import builtins
    import tempfile

    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if os.path.isdir(TESTKIT) and TESTKIT not in sys.path:
        sys.path.append(TESTKIT)
    try:
        import pytest
    except ImportError:
        raise TestFormUnavailable("pytest-form tests need pytest in the sandbox image") from None
    for name, value in names.items():  # the program's names as globals the test file can see
        if not hasattr(builtins, name):
            setattr(builtins, name, value)
    folder = tempfile.mkdtemp(prefix="modal-rl-tests-")
    path = os.path.join(folder, "test_task.py")
    with open(path, "w") as f:
        f.write(source)
    with open(os.path.join(folder, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")
    collector = _Collector()
    args = [path, "-q", "-p", "no:cacheprovider", "--capture=sys", "--noconftest"]
    args += ["-c", os.path.join(folder, "pytest.ini"), "--rootdir", folder, "-o", "python_files=test_task.py"]
    try:
        pytest.main(args, plugins=[collector])
    except BaseException as exc:  # cut short: collected items with no report fail below
        collector.errors.append(("pytest", False, describe(exc)))
    units = [(i, *collector.results.get(i, (False, "not run"))) for i in collector.items]
    return [u for u in units if u[1] is not None] + collector.errors


class _Collector:
    """A pytest plugin that keeps each item's outcome (None: skipped by the test's own markers)."""

    def __init__(self):
        self.items, self.results, self.errors = [], {}, []

    def pytest_collection_finish(self, session):
        self.items = [item.nodeid for item in session.items]

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append((report.nodeid or "collection", False, str(report.longrepr)[-300:]))

    def pytest_runtest_logreport(self, report):
        previous = self.results.get(report.nodeid)
        if report.failed:
            self.results[report.nodeid] = (False, str(report.longrepr)[-300:])
        elif report.skipped and previous is None:
            self.results[report.nodeid] = (None, "skipped")
        elif report.when == "call" and report.passed and previous is None:
            self.results[report.nodeid] = (True, "")
