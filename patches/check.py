"""The check: a series applies in order to a clean base, each fix's new tests flip, and the
listed upstream tests pass on the patched tree.

Per patch, on the tree with the earlier patches committed:
1. ``before`` (fixes only): only the patch's new test files are applied (``git apply
   --include``) and run; they must FAIL (a collection error counts: the test names the
   code that is missing). Then the tree is reset.
2. ``apply``: ``git am --keep-non-patch`` (the ``[module]`` prefix of upstream titles stays in
   the subject); it must apply without conflicts.
3. ``after``: the new tests must pass, with at least one test run (all skipped is a deviation:
   nothing was proven).
After the series: every patch's ``upstream_tests`` (and ``upstream_tests_full`` with
``full``) plus all new tests, in one run; they must pass. Then the base's ``sanity``
commands (the project's own pre-commit checks: license headers, test layout, linters) run
on the patched tree, ``{py_files}`` standing for the ``.py`` files the series adds or
changes; each must exit 0.

Invariants: the tests run with ``cwd`` = the tree and the tree (after the base's
``pythonpath`` folders in it) first on ``PYTHONPATH``, so
the patched package shadows any installed copy; a patch that does not apply stops its series
(later patches build on it); every deviation is a row whose ``ok`` is False.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from modal_rl import run_temp
from patches import base as bases
from patches.series import Series

RUN_TIMEOUT_S = 1800


@dataclass
class Run:
    """One test run: ``rc``, the junit counts (pytest runner) and a tail of its output."""

    rc: int
    tests: int = 0
    failures: int = 0
    skipped: int = 0
    seconds: float = 0.0
    tail: str = ""

    @property
    def summary(self) -> str:
        if self.tests:
            return f"{self.tests - self.failures - self.skipped}/{self.tests} pass" + (
                f", {self.skipped} skip" if self.skipped else ""
            )
        return f"rc={self.rc}"


@dataclass
class Row:
    framework: str
    patch: str
    title: str
    applies: bool | None = None
    before: str = "-"
    after: str = "-"
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def run_tests(
    tree: Path,
    runner: str,
    files: list[str],
    env: dict[str, str],
    scratch: Path,
    pythonpath: tuple[str, ...] = (),
) -> Run:
    """Run ``files`` in ``tree`` with ``runner``; never raises for failing tests."""
    full_env = {**os.environ, **env}
    first = [str(tree / folder) for folder in pythonpath] + [str(tree)]
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH", "")) if p)
    # Upstream tests' own temp files (multiprocessing's pymp-* dirs outlive a test that exits
    # hard, Ray's session dir) go into a short run dir of ours (socket paths under it must stay
    # short), removed when the run ends: never into the caller's temp dir.
    temp = run_temp.make("pt")
    full_env.update(run_temp.child_env(temp))
    try:
        return _run_in(tree, runner, files, full_env, scratch)
    finally:
        run_temp.remove(temp)


def _run_in(tree: Path, runner: str, files: list[str], full_env: dict[str, str], scratch: Path) -> Run:
    started = time.monotonic()
    if runner == "pytest":
        xml = scratch / f"junit-{time.monotonic_ns()}.xml"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
        proc = _run(argv, tree, full_env)
        result = Run(proc.returncode, seconds=time.monotonic() - started, tail=_tail(proc))
        if xml.is_file():
            root = ET.parse(xml).getroot()
            for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
                result.tests += int(suite.get("tests", 0))
                result.failures += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
                result.skipped += int(suite.get("skipped", 0))
        return result
    rc, tails = 0, []
    for file in files:
        proc = _run([sys.executable, file], tree, full_env)
        rc = rc or proc.returncode
        tails.append(f"{file}: rc={proc.returncode}\n{_tail(proc)}")
    return Run(rc, seconds=time.monotonic() - started, tail="\n".join(tails))


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(argv, 124, out, f"timed out after {RUN_TIMEOUT_S} s")


def _tail(proc: subprocess.CompletedProcess, lines: int = 25) -> str:
    return "\n".join(((proc.stdout or "") + (proc.stderr or "")).strip().splitlines()[-lines:])


def _passed(run: Run) -> bool:
    return run.rc == 0 and (run.tests == 0 or run.tests > run.skipped)


def check_series(
    series: Series, source: str | None, *, full: bool = False, keep: Path | None = None, log=print
):
    """Run the check for ``series`` on a clean copy of its base from ``source``; returns rows."""
    scratch = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=f"patches-{series.framework}-"))
    rows: list[Row] = []
    env = {k: str(v) for k, v in series.base.env.items()}
    try:
        try:
            tree = bases.prepare(series.base, source, scratch)
        except bases.BaseError as exc:
            return [Row(series.framework, "base", series.base.name, problems=[str(exc)])]
        log(f"[patches] {series.framework}: base {series.base.name} at {tree}")
        base_rev = bases.git(tree, "rev-parse", "HEAD").stdout.strip()
        for patch in series.patches:
            row = Row(series.framework, patch.file.name, patch.title)
            rows.append(row)
            started = time.monotonic()
            tests = list(patch.new_tests)
            if patch.fix:
                include = [arg for t in tests for arg in ("--include", t)]
                bases.git(tree, "apply", *include, str(patch.file))
                before = run_tests(tree, series.base.runner, tests, env, scratch, series.base.pythonpath)
                bases.git(tree, "reset", "-q", "--hard")
                bases.git(tree, "clean", "-q", "-fdx")
                row.before = ("FAIL " if before.rc != 0 else "pass ") + before.summary
                if before.tests and before.skipped == before.tests:
                    row.problems.append(
                        f"new tests were all skipped before the fix (nothing proven):\n{before.tail}"
                    )
                elif before.rc == 0:
                    row.problems.append(f"new tests did not fail before the fix:\n{before.tail}")
            am = bases.git(tree, "am", "-q", "--keep-non-patch", str(patch.file), check=False)
            row.applies = am.returncode == 0
            if not row.applies:
                bases.git(tree, "am", "--abort", check=False)
                row.problems.append(f"does not apply: {(am.stderr or am.stdout).strip()}")
                row.seconds = time.monotonic() - started
                break
            after = run_tests(tree, series.base.runner, tests, env, scratch, series.base.pythonpath)
            bases.git(tree, "clean", "-q", "-fdx")
            row.after = ("pass " if _passed(after) else "FAIL ") + after.summary
            if not _passed(after):
                row.problems.append(f"new tests fail after the patch:\n{after.tail}")
            row.seconds = time.monotonic() - started
            log(f"[patches] {patch.file.name}: before {row.before}; after {row.after}")
        if len(rows) == len(series.patches) and all(r.applies for r in rows):
            rows.append(_final(series, tree, env, scratch, full))
            if series.base.sanity:
                rows.append(run_sanity(series, tree, base_rev))
        return rows
    finally:
        if not keep:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)


def _final(series: Series, tree: Path, env: dict[str, str], scratch: Path, full: bool) -> Row:
    """All new tests and the listed upstream tests on the fully patched tree."""
    files: list[str] = []
    for patch in series.patches:
        for f in (*patch.new_tests, *patch.upstream_tests, *(patch.upstream_tests_full if full else ())):
            if f not in files:
                files.append(f)
    row = Row(series.framework, "series", f"all {len(series.patches)} patches: new + upstream tests")
    row.applies = True
    run = run_tests(tree, series.base.runner, files, env, scratch, series.base.pythonpath)
    row.after = ("pass " if _passed(run) else "FAIL ") + run.summary
    row.seconds = run.seconds
    if not _passed(run):
        row.problems.append(f"tests fail on the patched tree:\n{run.tail}")
    return row


# Tools a sanity command may name bare; they run from this interpreter's environment.
_MODULE_TOOLS = {"python": None, "python3": None, "ruff": "ruff", "isort": "isort"}


def sanity_argv(command: str, py_files: list[str]) -> list[str]:
    """``command`` as an argv: ``python``/``ruff``/``isort`` run from this interpreter, and
    ``{py_files}`` expands to ``py_files`` (the series' own Python files)."""
    argv: list[str] = []
    for word in shlex.split(command):
        argv += py_files if word == "{py_files}" else [word]
    tool = argv[0] if argv else ""
    if tool in _MODULE_TOOLS:
        module = _MODULE_TOOLS[tool]
        argv = [sys.executable, *(["-m", module] if module else []), *argv[1:]]
    return argv


def run_sanity(series: Series, tree: Path, base_rev: str) -> Row:
    """The base's ``sanity`` commands on the patched ``tree``; one row, a problem per failure."""
    changed = bases.git(tree, "diff", "--name-only", "--diff-filter=AM", base_rev, "HEAD", "--", "*.py")
    py_files = sorted(line for line in changed.stdout.splitlines() if line)
    row = Row(series.framework, "sanity", f"{len(series.base.sanity)} project checks on the patched tree")
    row.applies = True
    started = time.monotonic()
    failed = 0
    for command in series.base.sanity:
        argv = sanity_argv(command, py_files)
        proc = _run(argv, tree, {**os.environ, **series.base.env})
        if proc.returncode != 0:
            failed += 1
            row.problems.append(f"`{command}` exited {proc.returncode}:\n{_tail(proc)}")
    row.after = (
        f"{'pass' if not failed else 'FAIL'} {len(series.base.sanity) - failed}/{len(series.base.sanity)}"
    )
    row.seconds = time.monotonic() - started
    return row


def apply_series(series: Series, source: str | None, scratch: Path) -> Path:
    """A clean base from ``source`` with the whole series committed on it (no tests run)."""
    tree = bases.prepare(series.base, source, scratch)
    for patch in series.patches:
        am = bases.git(tree, "am", "-q", "--keep-non-patch", str(patch.file), check=False)
        if am.returncode != 0:
            raise bases.BaseError(f"{patch.file.name} does not apply: {(am.stderr or am.stdout).strip()}")
    return tree


def table(rows: list[Row]) -> str:
    """The summary table (one line per patch, then the series line)."""
    head = ("framework", "patch", "applies", "before (must fail)", "after (must pass)", "s", "ok")
    body = [
        (
            r.framework,
            r.patch[:58],
            {True: "yes", False: "NO", None: "-"}[r.applies],
            r.before,
            r.after,
            f"{r.seconds:.0f}",
            "ok" if r.ok else "DEVIATION",
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in (head, *body)]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def as_json(rows: list[Row]) -> list[dict]:
    return [{**asdict(r), "ok": r.ok} for r in rows]
