"""The dataset's test code, run as it is written, in the runner (stdlib, and pytest when used).

``run(spec, names, deadline, channel, emit)`` picks the form from the test code's own structure
and reports one ``(name, passed, why)`` per test unit through ``emit`` as soon as it is decided:
- **unittest** (a ``unittest.TestCase`` subclass): the real ``unittest`` loader and runner; a unit
  is a test method (failed subtests fail it);
- **pytest** (defines tests pytest would collect, ``test_*`` functions or ``Test*`` classes, *and*
  has no module-level check): the real pytest (fixtures, classes, parametrize); a unit is a
  collected item, a collection error a failed unit, an item skipped by the test's own markers is
  not counted, an item collected but never reported (the run was cut short) fails;
- **script** (everything else: asserts, HumanEval's ``check(candidate)``, raise-based checks, a
  file with a ``test_case(inp, want)`` helper it calls itself): the file runs as ``__main__``, one
  top-level statement at a time. A unit is a statement that checks something (an ``assert``, a
  ``raise``, a call other than a bare ``print``); docstrings, constants, bare prints and
  definitions are not units. A definition that raises fails every unit after it. A ``check``
  that is defined and never called is called with ``candidate`` (the entry point).
Names are bound by declaration (``declared_names``): the test sees the dataset's prelude, its own
names, the builtins, and of the program only the entry point and the names the test itself uses
or imports from ``solution`` — never a builtin or a name the test or prelude binds, whatever the
program defines. A test that patches the program's names (``mock.patch('solution.f')``), imports
a package the sandbox lacks, or has no unit, is a bad test (``BadTests``), never a score.
"""

import ast
import builtins
import os
import signal
import sys
import time
import types

_DEFS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_DEFS += (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass, ast.Global)
TESTKIT = "/opt/modal-rl/testkit"  # where a sandbox finds pytest (testrun.testkit_binds)


class TestFormUnavailable(Exception):
    """The sandbox cannot run this test form (no pytest in its image)."""


class BadTests(Exception):
    """The tests cannot judge any program (no unit, a missing package, a patch of the program)."""


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


# -- what a statement is ------------------------------------------------------------------------
def _calls(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _is_print(call):
    return isinstance(call.func, ast.Name) and call.func.id == "print"


def is_unit(stmt):
    """A top-level statement that checks something: it asserts, raises, or calls something other
    than a bare print. Definitions, docstrings, constants and prints are not units."""
    if isinstance(stmt, _DEFS):
        return False
    if any(isinstance(n, ast.Assert | ast.Raise) for n in ast.walk(stmt)):
        return True
    return any(not _is_print(c) for c in _calls(stmt))


def _collectable(tree):
    return any(
        (isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test"))
        or (isinstance(n, ast.ClassDef) and n.name.startswith("Test"))
        for n in tree.body
    )


def form_of(tree):
    for n in tree.body:
        if isinstance(n, ast.ClassDef) and any(ast.unparse(b).endswith("TestCase") for b in n.bases):
            return "unittest"
    if _collectable(tree) and not any(is_unit(s) for s in tree.body):
        return "pytest"
    return "script"


def _calls_check(tree):
    return any(isinstance(c.func, ast.Name) and c.func.id == "check" for c in _calls(tree))


def script_units(tree, entry_point):
    units = [s for s in tree.body if is_unit(s)]
    defines_check = any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in tree.body)
    return units, bool(defines_check and entry_point and not _calls_check(tree))


def _name(stmt):
    return f"line {stmt.lineno}: {ast.unparse(stmt).splitlines()[0][:160]}"


# -- names by declaration -----------------------------------------------------------------------
def _bound(tree):
    """Names a module binds at its top level (assignments, definitions, imports, loop targets)."""
    names = set()
    for stmt in tree.body:
        for node in ast.walk(stmt) if not isinstance(stmt, ast.FunctionDef | ast.ClassDef) else [stmt]:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Import | ast.ImportFrom) and not _from_solution(node):
                names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
    return names


def _from_solution(node):
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "solution"


def _doctest_names(text):
    """Names the doctest examples in a string use (``doctest.testmod()`` runs them)."""
    import doctest

    names = set()
    try:
        examples = doctest.DocTestParser().get_examples(text)
    except ValueError:
        return names
    for example in examples:
        try:
            names |= _used(ast.parse(example.source))
        except SyntaxError:
            continue
    return names


def _used(tree):
    """Names the tests use: loaded names (in doctest examples too), names imported from
    ``solution``, ``solution.x``."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is str and ">>>" in node.value:
            used |= _doctest_names(node.value)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used.add(node.id)
        elif _from_solution(node):
            used.update(a.name for a in node.names)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "solution"
        ):
            used.add(node.attr)
    return used


def value_class_names(*trees):
    return {n.name for tree in trees for n in tree.body if isinstance(n, ast.ClassDef)}


def declared_names(tree, prelude_tree, program_names, entry_point):
    """The program's names the test sees: {name: kind}. The entry point always; otherwise the
    functions and classes the test uses or imports, never a builtin or a name the test or the
    prelude binds. A class counts as a class only under a CapWords name: a lower-case class is
    called like the function its name says it is (``class_names``)."""
    kinds = {n: k for n, k in program_names}
    taken = _bound(tree) | _bound(prelude_tree) | set(dir(builtins))
    used = _used(tree)
    out = {n: kinds[n] for n in used if n in kinds and n not in taken and kinds[n] != "value"}
    for n in used:
        if n in kinds and kinds[n] == "value" and n not in taken:
            out[n] = "value"
    if entry_point and entry_point in kinds:
        out[entry_point] = kinds[entry_point]
    return out


def class_names(declared):
    return {n for n, k in declared.items() if k == "class" and n[:1].isupper()}


class SolutionModule(types.ModuleType):
    """Module ``solution`` as the test sees it; a test that rebinds one of its names after set-up
    (``mock.patch('solution.f')``, ``monkeypatch.setattr(solution, ...)``) would patch a stand-in
    the program never calls: that makes the tests bad, never a silent 0."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_mrl_sealed"):
            self.__dict__["_mrl_patched"] = name
        super().__setattr__(name, value)

    def __getattr__(self, name):
        getter = self.__dict__.get("_mrl_get")
        if getter is None or name.startswith("__"):
            raise AttributeError(name)
        return getter(name)


# -- running ------------------------------------------------------------------------------------
def run(spec, bound, deadline, emit, set_total, spaces):
    """Run the tests against ``bound`` (the declared names, with ``candidate``); ``spaces`` gets
    the namespaces the tests run in (where the runner finds the test's classes by name)."""
    tree = ast.parse(spec["tests"])
    form = form_of(tree)
    prelude = spec.get("prelude") or ""
    arm(deadline)
    try:
        if form == "script":
            return _run_script(tree, prelude, bound, spec.get("entry_point"), emit, set_total, spaces)
        if form == "unittest":
            return _run_unittest(spec["tests"], prelude, bound, emit, set_total, spaces)
        return _run_pytest(spec["tests"], prelude, bound, emit, set_total, spaces)
    finally:
        disarm()


def failed_units(spec, why):
    """Every unit the test defines, failed (the program did not load)."""
    tree = ast.parse(spec["tests"])
    if form_of(tree) == "script":
        units, call_check = script_units(tree, spec.get("entry_point"))
        return [(_name(s), False, why) for s in units] + (
            [("check(candidate)", False, why)] if call_check else []
        )
    return [("tests", False, why)]


def _missing_package(exc, stmt):
    """A test's own import of a package the sandbox lacks: a bad test, not a failure."""
    return (
        isinstance(exc, ImportError)
        and isinstance(stmt, ast.Import | ast.ImportFrom)
        and not _from_solution(stmt)
    )


def _run_script(tree, prelude, bound, entry, emit, set_total, spaces):
    main = types.ModuleType("__main__")  # the test is __main__ (doctest.testmod() finds it there)
    sys.modules["__main__"] = main
    ns = main.__dict__
    ns["__builtins__"] = builtins
    spaces.append(ns)
    if prelude:
        exec(compile(prelude, "<prelude>", "exec"), ns)
    ns.update(bound)
    units, call_check = script_units(tree, entry)
    set_total(len(units) + call_check)
    setup_error = None
    for stmt in tree.body:
        unit = is_unit(stmt)
        if setup_error is not None:
            if unit:
                emit(_name(stmt), False, f"setup failed: {setup_error}")
            continue
        try:
            exec(compile(ast.Module([stmt], []), "<test>", "exec"), ns)
            if unit:
                emit(_name(stmt), True, "")
        except BaseException as exc:  # Deadline too: this statement did not finish
            if _missing_package(exc, stmt):
                raise BadTests(f"the tests import a package the sandbox lacks: {describe(exc)}") from None
            if unit:
                emit(_name(stmt), False, describe(exc))
            else:
                setup_error = describe(exc)
    if call_check:
        try:
            if setup_error is not None:
                raise RuntimeError(f"setup failed: {setup_error}")
            if "candidate" not in ns:
                raise NameError(f"the program defines no {entry!r}")
            ns["check"](ns["candidate"])
            emit("check(candidate)", True, "")
        except BaseException as exc:
            emit("check(candidate)", False, describe(exc))
    return ns


def _run_unittest(source, prelude, bound, emit, set_total, spaces):
    import unittest

    module = types.ModuleType("test_task")
    spaces.append(module.__dict__)
    if prelude:
        exec(compile(prelude, "<prelude>", "exec"), module.__dict__)
    module.__dict__.update(bound)
    sys.modules["test_task"] = module
    try:
        exec(compile(source, "test_task.py", "exec"), module.__dict__)
    except ImportError as exc:
        raise BadTests(f"the tests import a package the sandbox lacks: {describe(exc)}") from None
    except BaseException as exc:  # unittest.main() at top level ends in SystemExit: keep going
        if not isinstance(exc, SystemExit):
            set_total(1)
            emit("module", False, describe(exc))
            return module.__dict__
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    ids = [t.id() for t in _flatten(suite)]
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

        def stopTest(self, test):
            result = outcome.get(test.id(), (False, "not run"))
            if result is not None:
                emit(test.id(), *result)

    set_total(len(ids))
    try:
        suite.run(Result())
    except BaseException as exc:  # the run was cut short: what did not report fails
        for i in ids:
            if i not in outcome:
                emit(i, False, describe(exc))
    return module.__dict__


def _flatten(suite):
    for t in suite:
        yield from (_flatten(t) if hasattr(t, "__iter__") else [t])


def _run_pytest(source, prelude, bound, emit, set_total, spaces):
    import tempfile

    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        import pytest
    except ImportError:
        raise TestFormUnavailable("pytest-form tests need pytest in the sandbox image") from None
    visible = {}
    spaces.append(visible)
    if prelude:
        exec(compile(prelude, "<prelude>", "exec"), visible)
        visible.pop("__builtins__", None)
    visible.update(bound)
    for name, value in visible.items():  # globals the test file can see; its own names win
        if not hasattr(builtins, name):
            setattr(builtins, name, value)
    folder = tempfile.mkdtemp(prefix="modal-rl-tests-")
    path = os.path.join(folder, "test_task.py")
    with open(path, "w") as f:
        f.write(source)
    with open(os.path.join(folder, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")
    collector = _Collector(emit, set_total)
    args = [path, "-q", "-p", "no:cacheprovider", "--capture=sys", "--noconftest"]
    args += ["-c", os.path.join(folder, "pytest.ini"), "--rootdir", folder, "-o", "python_files=test_task.py"]
    try:
        pytest.main(args, plugins=[collector])
    except BaseException as exc:  # cut short: collected items with no report fail below
        collector.cut = describe(exc)
    if collector.bad:
        raise BadTests(collector.bad)
    collector.finish()
    module = sys.modules.get("test_task")
    return {**visible, **(vars(module) if module else {})}


class _Collector:
    """A pytest plugin that emits each item's outcome as it is decided (skips are not units)."""

    def __init__(self, emit, set_total):
        self.emit, self.set_total = emit, set_total
        self.items, self.results, self.errors, self.cut, self.bad = [], {}, 0, None, None

    def pytest_collection_finish(self, session):
        self.items = [item.nodeid for item in session.items]
        self.set_total(len(self.items) + self.errors)

    def pytest_collectreport(self, report):
        if report.failed:
            longrepr = str(report.longrepr)
            tail = longrepr.split("ModuleNotFoundError")[-1][:200]
            if "ModuleNotFoundError" in longrepr and "solution" not in tail:
                self.bad = f"the tests import a package the sandbox lacks: ModuleNotFoundError{tail}"
                return
            self.errors += 1
            self.emit(report.nodeid or "collection", False, longrepr[-300:])

    def pytest_runtest_logreport(self, report):
        previous = self.results.get(report.nodeid)
        if report.failed and previous is not False:
            self.results[report.nodeid] = False
            self.emit(report.nodeid, False, str(report.longrepr)[-300:])
        elif report.skipped and previous is None:
            self.results[report.nodeid] = "skipped"
        elif report.when == "teardown" and previous is None:
            self.results[report.nodeid] = True
            self.emit(report.nodeid, True, "")

    def finish(self):
        for nodeid in self.items:
            if nodeid not in self.results:
                self.emit(nodeid, False, self.cut or "not run")
