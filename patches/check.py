"""The check: a series applies in order to a clean base, each fix's new tests flip, and the
listed upstream tests pass on the patched tree.

The series is first committed on the base in order (``git am --keep-non-patch``: the
``[module]`` prefix of upstream titles stays in the subject); a patch that does not apply
cleanly stops there. Then, per patch, on the tree with the earlier patches committed:
1. ``before`` (fixes only): only the patch's new test files are added (``git apply
   --include``) and run; they must FAIL (a collection error counts: the test names the
   code that is missing).
2. ``after`` (on the tree with the patch committed): the new tests must pass, with at least
   one test run (all skipped is a deviation: nothing was proven).
After the series: every patch's ``upstream_tests`` (and ``upstream_tests_full`` with
``full``) plus all new tests, in one run; they must pass. Then the base's ``sanity``
commands (the project's own pre-commit checks: license headers, test layout, linters) run
on the patched tree, ``{py_files}`` standing for the ``.py`` files the series adds or
changes; each must exit 0.

Shared runs (pytest runner): patch N's ``after`` and patch N+1's ``before`` need the same
tree (patches 1..N committed; N+1's test files are only added), so they are one pytest
process, and the last patch's ``after`` is part of the series run. Start-up (imports of
torch, vLLM, the trainer stack) is most of a run's time, so this halves the runs. Each
verdict is still taken from its own test files alone: the junit report (``xunit1``) names
each case's file, and ``--continue-on-collection-errors`` keeps a collection error (a
``before`` naming code that is not there yet) that file's failure instead of stopping the
run. What two patches' files share is the interpreter, as in the series run. The runs on
different trees are independent stages (:mod:`patches.stages`), run side by side in
worktrees of the check's tree.

Invariants: the tests run with ``cwd`` = the tree and the tree (after the base's
``pythonpath`` folders in it) first on ``PYTHONPATH``, so
the patched package shadows any installed copy; a patch that does not apply stops its series
(later patches build on it) but its ``before`` still runs; every deviation is a row whose
``ok`` is False. A row's ``seconds`` is the time of applying it and of the run that proves
its ``before`` (shared with the previous patch's ``after``); the series row holds the last
patch's ``after``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from modal_rl import run_temp
from patches import base as bases
from patches import stages
from patches.series import Series

RUN_TIMEOUT_S = 1800
# pytest's own exit statuses (all passed, tests failed, interrupted, internal error, usage
# error, no tests collected); anything else came from the interpreter, not from pytest.
PYTEST_EXIT_CODES = range(6)
# Each case names its file (xunit1), and a file that fails to import is that file's error
# instead of interrupting the run: what lets one run carry two patches' verdicts.
PYTEST_REPORT = ("-o", "junit_family=xunit1", "--continue-on-collection-errors")
_OUTCOMES = {"failure": "fail", "error": "fail", "skipped": "skip"}


@dataclass
class Run:
    """One test run: ``rc``, the junit counts (pytest runner) and a tail of its output."""

    rc: int
    tests: int = 0
    failures: int = 0
    skipped: int = 0
    seconds: float = 0.0
    tail: str = ""
    # (test file as the junit report names it, "pass" | "fail" | "skip") per case (pytest)
    cases: list[tuple[str, str]] = field(default_factory=list)
    # the process's own exit status when ``rc`` was taken from its junit report instead
    exit_rc: int | None = None

    def count(self, cases: list[tuple[str, str]]) -> Run:
        """Take ``cases`` as this run's cases and counts."""
        self.cases = cases
        self.tests = len(cases)
        self.failures = sum(o == "fail" for _f, o in cases)
        self.skipped = sum(o == "skip" for _f, o in cases)
        return self

    @property
    def summary(self) -> str:
        if self.tests:
            text = f"{self.tests - self.failures - self.skipped}/{self.tests} pass" + (
                f", {self.skipped} skip" if self.skipped else ""
            )
            # a status that disagrees with the cases is part of the verdict's reason
            odd = self.rc not in (0, 1) or (self.rc == 1) != bool(self.failures)
            return (
                text
                + (f", rc={self.rc}" if odd else "")
                + (f", exit {self.exit_rc}" if self.exit_rc is not None else "")
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
        xml = scratch / f"junit-{uuid.uuid4().hex}.xml"  # stages run side by side
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PYTEST_REPORT]
        proc = _run([*argv, f"--junitxml={xml}", *files], tree, full_env)
        result = Run(proc.returncode, seconds=time.monotonic() - started, tail=_tail(proc))
        if not xml.is_file():
            return result
        return _judged_by_report(result.count(_junit_cases(xml)))
    rc, tails = 0, []
    for file in files:
        proc = _run([sys.executable, file], tree, full_env)
        rc = rc or proc.returncode
        tails.append(f"{file}: rc={proc.returncode}\n{_tail(proc)}")
    return Run(rc, seconds=time.monotonic() - started, tail="\n".join(tails))


def _judged_by_report(run: Run) -> Run:
    """A pytest process that wrote its junit report finished running every test; an exit
    status pytest never gives (a signal, a timeout kill, ``os._exit`` from a library's exit
    hook: vLLM, Ray and torch threads on a loaded host) came after the verdicts, so the
    report's verdicts decide and the raw status is kept in ``exit_rc`` and the tail. A
    process that died before its report keeps its status (no report: a failed run)."""
    if run.rc in PYTEST_EXIT_CODES:
        return run
    run.exit_rc = run.rc
    run.rc = 1 if run.failures else (0 if run.tests else 5)
    run.tail += (
        f"\n[patches] the process exited with status {run.exit_rc} after pytest wrote its "
        "report; judged by the report"
    )
    return run


def _junit_cases(xml: Path) -> list[tuple[str, str]]:
    """(file, outcome) per test case of a junit report; a collection error is a failing case."""
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        marks = [_OUTCOMES[c.tag] for c in case if c.tag in _OUTCOMES]
        cases.append((case.get("file") or "", "fail" if "fail" in marks else marks[0] if marks else "pass"))
    return cases


def run_groups(
    tree: Path,
    runner: str,
    groups: list[list[str]],
    env: dict[str, str],
    scratch: Path,
    pythonpath: tuple[str, ...] = (),
) -> list[Run]:
    """One run per group of test files, as if each were run alone; with pytest, one process
    runs them all and each group's result counts only its own files' cases."""
    if runner != "pytest" or len(groups) < 2:
        return [run_tests(tree, runner, files, env, scratch, pythonpath) for files in groups]
    union = list(dict.fromkeys(f for files in groups for f in files))
    run = run_tests(tree, runner, union, env, scratch, pythonpath)
    owners = {case_file: _owner(case_file, union) for case_file, _o in run.cases}
    return [_part(run, files, owners) for files in groups]


def _owner(case_file: str, files: list[str]) -> str | None:
    """The listed file a junit case belongs to (its path may be relative to another rootdir)."""
    if case_file in files:
        return case_file
    matches = [f for f in files if case_file and (f.endswith("/" + case_file) or case_file.endswith("/" + f))]
    return max(matches, key=len) if matches else None


def _part(run: Run, files: list[str], owners: dict[str, str | None]) -> Run:
    """``run`` as seen by ``files``: their cases, plus any failing case no listed file owns."""
    cases = [(f, o) for f, o in run.cases if owners[f] in files or (owners[f] is None and o == "fail")]
    part = Run(run.rc, seconds=run.seconds, tail=run.tail, exit_rc=run.exit_rc).count(cases)
    if run.rc in (0, 1):  # pytest: all passed / some test failed (or a file failed to import)
        part.rc = 1 if part.failures else (0 if part.tests else 5)  # 5: pytest's "no tests ran"
    return part


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
    series: Series,
    source: str | None,
    *,
    full: bool = False,
    keep: Path | None = None,
    log=print,
    jobs: int | None = None,
):
    """Run the check for ``series`` on a clean copy of its base from ``source``; returns rows.
    ``jobs``: test stages run side by side (default :func:`patches.stages.default_jobs`)."""
    scratch = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=f"patches-{series.framework}-"))
    rows: list[Row] = []
    env = {k: str(v) for k, v in series.base.env.items()}
    runner, pythonpath = series.base.runner, series.base.pythonpath
    try:
        try:
            tree = bases.prepare(series.base, source, scratch)
        except bases.BaseError as exc:
            return [Row(series.framework, "base", series.base.name, problems=[str(exc)])]
        log(f"[patches] {series.framework}: base {series.base.name} at {tree}")
        commits = [bases.git(tree, "rev-parse", "HEAD").stdout.strip()]
        for patch in series.patches:
            row = Row(series.framework, patch.file.name, patch.title)
            rows.append(row)
            started = time.monotonic()
            am = bases.git(tree, "am", "-q", "--keep-non-patch", str(patch.file), check=False)
            row.applies = am.returncode == 0
            row.seconds = time.monotonic() - started
            if not row.applies:
                bases.git(tree, "am", "--abort", check=False)
                row.problems.append(f"does not apply: {(am.stderr or am.stdout).strip()}")
                break
            commits.append(bases.git(tree, "rev-parse", "HEAD").stdout.strip())
        complete = len(commits) == len(series.patches) + 1
        plan = stages.plan(
            series.patches, commits, len(rows), _series_files(series, full) if complete else None
        )
        results = stages.run_all(
            tree,
            plan,
            lambda where, groups: run_groups(where, runner, groups, env, scratch, pythonpath),
            scratch,
            stages.default_jobs() if jobs is None else jobs,
            log,
        )
        final = Row(series.framework, "series", f"all {len(series.patches)} patches: new + upstream tests")
        for stage, runs in zip(plan, results, strict=True):
            for group, run in zip(stage.groups, runs, strict=True):
                if group.kind == "before":
                    _record_before(rows[group.patch], run)
                    rows[group.patch].seconds += run.seconds
                elif group.kind == "after":
                    _record_after(rows[group.patch], group.files, run, log)
                else:
                    _record_series(final, run)
        if complete:
            rows.append(final)
            if series.base.sanity:
                rows.append(run_sanity(series, tree, commits[0]))
        return rows
    finally:
        if not keep:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)


def _record_before(row: Row, before: Run) -> None:
    row.before = ("FAIL " if before.rc != 0 else "pass ") + before.summary
    if before.tests and before.skipped == before.tests:
        row.problems.append(f"new tests were all skipped before the fix (nothing proven):\n{before.tail}")
    elif before.rc == 0:
        row.problems.append(f"new tests did not fail before the fix:\n{before.tail}")


def _record_after(row: Row, tests: list[str], after: Run, log) -> None:
    row.after = ("pass " if _passed(after) else "FAIL ") + after.summary
    if not _passed(after):
        row.problems.append(f"new tests fail after the patch ({', '.join(tests)}):\n{after.tail}")
    log(f"[patches] {row.patch}: before {row.before}; after {row.after}")


def _series_files(series: Series, full: bool) -> list[str]:
    """All new tests and the listed upstream tests, for the run on the fully patched tree."""
    files: list[str] = []
    for patch in series.patches:
        for f in (*patch.new_tests, *patch.upstream_tests, *(patch.upstream_tests_full if full else ())):
            if f not in files:
                files.append(f)
    return files


def _record_series(row: Row, run: Run) -> None:
    row.applies = True
    row.after = ("pass " if _passed(run) else "FAIL ") + run.summary
    row.seconds = run.seconds
    if not _passed(run):
        row.problems.append(f"tests fail on the patched tree:\n{run.tail}")


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
