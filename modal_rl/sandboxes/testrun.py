"""Host side of a test run: ship the trusted runner, read its report with bounds.

One exec per scored sample runs the runner (``_runner``); the runner starts the program in a
process it can never be reached from (``_isolation``), runs the dataset's tests as written
(``_testforms``) against the program as a remote module (``_plainwire``), and writes its verdict
to a stdout only it holds. The host never sees a value of the program's: it reads the runner's
report lines, and ``parse_report`` reads them with bounds (line count, field count, lengths; no
recursion, no JSON, nothing formatted from them). What the program can cause (a crash, a hang, a
flood, a killed runner) leaves a failing or missing report: a score of 0. What it cannot cause
(no isolation here, no pytest in the image) is an ``InfraUnavailable``: the caller masks it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from modal_rl.sandboxes.errors import SandboxError

_HERE = Path(__file__).parent
_PARTS = ("_valuekinds", "_plainwire", "_program", "_isolation", "_testforms", "_handles", "_runner")
MAX_UNITS = 10_000
# pytest and what it imports, and numpy (tests in EvalPlus's shape compare with it), bound
# read-only into local sandboxes; the runner puts them on its path before it starts the program,
# so the program can import them too (reading a package is no way to the runner).
TESTKIT_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py", "numpy")
TESTKIT_DIR = "/opt/modal-rl/testkit"
RUNNER_DIR = "/opt/modal-rl/runner"  # the runner's own modules, where a sandbox has them
UNIT, NOTE, DONE, INFRA = "MODAL_RL_UNIT", "MODAL_RL_NOTE", "MODAL_RL_DONE", "MODAL_RL_INFRA"
TOTAL, DECIDES, BAD = "MODAL_RL_TOTAL", "MODAL_RL_DECIDES", "MODAL_RL_BADTESTS"


class InfraUnavailable(SandboxError):
    """The sandbox cannot run the tests as required (isolation or a test form's tools missing)."""


def runner_source() -> str:
    """One ``python3 -I -S -c`` script: the runner's modules, each made a module of its own.
    Where the sandbox has them read-only at ``RUNNER_DIR`` (local sandboxes: ``testkit_binds``,
    with the host's compiled bytecode beside them), they are imported from there instead, which
    saves compiling ~2,000 lines for every sample (~30 ms)."""
    lines = ["import os, sys, types", f"if os.path.isfile({RUNNER_DIR + '/_runner.py'!r}):"]
    lines += [f"    sys.path.insert(0, {RUNNER_DIR!r})", "    import _runner", "else:"]
    lines += [
        "    def _module(name, src):",
        "        m = types.ModuleType(name)",
        "        sys.modules[name] = m",
    ]
    lines += ["        exec(compile(src, name + '.py', 'exec'), m.__dict__)", "        return m"]
    for name in _PARTS:
        lines.append(f"    _module({name!r}, {(_HERE / f'{name}.py').read_text()!r})")
    lines.append("sys.modules['_runner'].main()")
    return "\n".join(lines) + "\n"


RUNNER_SOURCE = runner_source()


def payload(
    program: str, tests: str, entry_point: str | None, deadline_s: float, prelude: str | None = None
) -> bytes:
    """The runner's stdin: the program first (read alone, before the fork), then the tests.
    ``prelude`` is the dataset's trusted code the tests build on (a prompt's helpers, starter
    classes): it runs in the tests' namespace first, and the program never shadows its names."""
    code = program.encode("utf-8", "surrogatepass")
    helpers = (prelude or "").encode("utf-8", "surrogatepass")
    # the same limit as a wall-clock time, from now (the exec's start): a runner slow to start
    # on a loaded host still reports before the exec's own deadline kills it
    spec = {"tests": tests, "entry_point": entry_point, "deadline_s": deadline_s, "prelude": prelude}
    spec["deadline_wall"] = time.time() + deadline_s
    head = len(code).to_bytes(4, "big") + code + len(helpers).to_bytes(4, "big") + helpers
    return head + json.dumps(spec).encode()


def check_test_code(tests: str) -> None:
    """Raises ``ValueError`` (naming the line) if the dataset's test code is not Python."""
    try:
        ast.parse(tests)
    except SyntaxError as exc:
        raise ValueError(f"test code does not parse: line {exc.lineno}: {exc.msg}") from exc


@functools.cache
def _testkit_binds() -> tuple[str, ...]:
    args = []
    for name in TESTKIT_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        src = origin.parent if origin.name == "__init__.py" else origin
        args += ["--ro-bind", str(src), f"{TESTKIT_DIR}/{src.name}"]
        libs = src.parent / f"{src.name}.libs"  # a wheel's bundled shared libraries, found beside it
        if libs.is_dir():
            args += ["--ro-bind", str(libs), f"{TESTKIT_DIR}/{libs.name}"]
    return tuple(args)


@functools.cache
def _runner_binds() -> tuple[str, ...]:
    """The runner's modules, compiled once here so the sandbox's Python (this one) reads their
    bytecode instead of compiling them for every sample."""
    import py_compile

    for name in _PARTS:
        source = _HERE / f"{name}.py"
        try:
            py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)), doraise=True)
        except (OSError, py_compile.PyCompileError):
            return ()  # a read-only install: the sandbox compiles the embedded source instead
    return ("--ro-bind", str(_HERE), RUNNER_DIR)


def testkit_binds() -> list[str]:
    """bwrap args that give a host-mode sandbox pytest and numpy at ``TESTKIT_DIR`` and the
    runner's modules at ``RUNNER_DIR`` (all read-only)."""
    return list(_testkit_binds()) + list(_runner_binds())


@dataclass
class Report:
    units: list[tuple[str, bool, str]] = field(default_factory=list)
    note: str | None = None  # why every unit failed, once (the program did not load)
    complete: bool = False  # the closing line came and matched the units
    total: int | None = None  # units the tests define, when the runner knew them before running
    decides: int = 0  # comparisons and truth values the program's own methods decided
    bad: str | None = None  # the tests cannot judge a program: why (the sample is masked)

    def counted(self) -> tuple[int, int]:
        """(passed, total): a run cut short keeps every unit it decided; the rest fail."""
        passed = sum(ok for _, ok, _ in self.units)
        total = len(self.units) if self.complete else max(len(self.units), self.total or 0, 1)
        return passed, total


def parse_report(stdout: str) -> Report:
    """The runner's report in ``stdout`` (its own stream; bounded by the exec's output cap).
    Units are written as they are decided, so a report without its closing line (the runner
    was killed) still holds the units decided before. Raises ``InfraUnavailable`` for the
    runner's infrastructure line; a malformed line ends the report where it stands."""
    report = Report()
    for line in stdout.split("\n"):
        tag, _, rest = line.partition("\t")
        if tag == UNIT:
            fields = rest.split("\t", 2)
            if len(fields) != 3 or fields[0] not in ("0", "1") or len(report.units) >= MAX_UNITS:
                return report
            report.units.append((fields[1][:200], fields[0] == "1", fields[2][:300]))
        elif tag == TOTAL and report.total is None and _small_int(rest):
            report.total = int(rest)
        elif tag == DECIDES and _small_int(rest):
            report.decides = int(rest)
        elif tag == NOTE and report.note is None:
            report.note = rest[:300]
        elif tag == BAD:
            report.bad = rest[:300] or "the tests cannot judge a program"
            return report
        elif tag == INFRA:
            raise InfraUnavailable(f"the test runner cannot run here: {rest[:300]}")
        elif tag == DONE:
            report.complete = _small_int(rest) and int(rest) == len(report.units)
            return report
    return report


def _small_int(text: str) -> bool:
    return text.isdigit() and len(text) < 8


def local_runner_argv() -> list[str]:
    return ["python3", "-I", "-S", "-c", RUNNER_SOURCE]


def deadline_for(timeout_s: float) -> float:
    """The runner's own limit: short of the exec's, so it always has time to report."""
    return max(0.5, timeout_s - max(0.5, 0.1 * timeout_s))
