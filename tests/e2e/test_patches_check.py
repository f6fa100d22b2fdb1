"""The patch check itself (``python -m patches``) on small synthetic series: it passes a
series whose fix really flips its test, and reports a deviation for each way a series can be
wrong (test already passing before, patch not applying, series file inconsistent).

The bases are tiny git repositories made here; the runner is real pytest in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from patches import base as bases
from patches import check
from patches.series import SeriesError, load

pytestmark = pytest.mark.slow  # real pytest subprocesses: ~30-50 s on a loaded 2-core box

GIT_ENV = ["-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *GIT_ENV, "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def _base(tmp: Path) -> tuple[Path, str]:
    """A repo whose ``calc.add`` subtracts (the bug)."""
    repo = tmp / "upstream"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "README").write_text("calc\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    return repo, _git(repo, "rev-parse", "HEAD").strip()


def _patch(repo: Path, out: Path, files: dict[str, str], message: str) -> str:
    """Commit ``files`` on top of HEAD, write it as a format-patch into ``out``, reset HEAD back."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", message)
    name = _git(repo, "format-patch", "-1", "-o", str(out)).strip().splitlines()[-1]
    _git(repo, "reset", "-q", "--hard", "HEAD~1")
    return Path(name).name


TEST_ADD = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
FIXED = "def add(a, b):\n    return a + b\n"


def _series(folder: Path, commit: str, entries: list[dict], runner: str = "pytest") -> Path:
    lines = ["[base]", 'name = "calc"', 'git = "local"', f'commit = "{commit}"', f'runner = "{runner}"', ""]
    for e in entries:
        lines += (
            ["[[patch]]"]
            + [
                f"{k} = {v!r}".replace("'", '"').replace("True", "true").replace("False", "false")
                for k, v in e.items()
            ]
            + [""]
        )
    path = folder / "series.toml"
    path.write_text("\n".join(lines))
    return path


def _fix_series(folder: Path, commit: str, name: str, test: str) -> Path:
    """A one-patch series: a fix of calc/__init__.py whose test must flip."""
    entry = dict(file=name, title="t", fix=True, targets=["calc/__init__.py"], new_tests=[test])
    return _series(folder, commit, [entry])


def _run(series_path: Path, repo: Path) -> list[check.Row]:
    return check.check_series(load(series_path), str(repo), log=lambda _m: None)


@pytest.fixture
def calc(tmp_path):
    repo, commit = _base(tmp_path)
    folder = tmp_path / "patches" / "calc"
    folder.mkdir(parents=True)
    return repo, commit, folder


def test_a_fix_that_flips_its_test_passes(calc):
    repo, commit, folder = calc
    name = _patch(
        repo,
        folder,
        {"calc/__init__.py": FIXED, "tests/test_add_on_cpu.py": TEST_ADD},
        "[calc] fix: add adds",
    )
    rows = _run(_fix_series(folder, commit, name, "tests/test_add_on_cpu.py"), repo)
    assert [r.ok for r in rows] == [True, True], [r.problems for r in rows]
    assert rows[0].before.startswith("FAIL 0/1") and rows[0].after.startswith("pass 1/1")
    assert rows[1].patch == "series"
    # the base repo was only read
    assert "a - b" in (repo / "calc" / "__init__.py").read_text() and not (repo / "tests").exists()


def test_a_test_that_passes_before_the_fix_is_a_deviation(calc):
    repo, commit, folder = calc
    trivial = "def test_nothing():\n    assert True\n"
    name = _patch(
        repo, folder, {"calc/__init__.py": FIXED, "tests/test_t_on_cpu.py": trivial}, "[calc] fix: add"
    )
    rows = _run(_fix_series(folder, commit, name, "tests/test_t_on_cpu.py"), repo)
    assert not rows[0].ok and "did not fail before" in rows[0].problems[0]


def test_a_patch_that_does_not_apply_is_a_deviation_and_stops_the_series(calc):
    repo, commit, folder = calc
    name = _patch(
        repo, folder, {"calc/__init__.py": FIXED, "tests/test_add_on_cpu.py": TEST_ADD}, "[calc] fix: add"
    )
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return b - a\n")  # upstream moved on
    _git(repo, "commit", "-qam", "moved")
    moved = _git(repo, "rev-parse", "HEAD").strip()
    entry = dict(
        file=name, title="t", fix=True, targets=["calc/__init__.py"], new_tests=["tests/test_add_on_cpu.py"]
    )
    rows = _run(_series(folder, moved, [entry, entry]), repo)
    assert len(rows) == 1 and rows[0].applies is False and "does not apply" in rows[0].problems[0]


def test_series_file_must_match_its_patches(calc):
    repo, commit, folder = calc
    name = _patch(
        repo, folder, {"calc/__init__.py": FIXED, "tests/test_add_on_cpu.py": TEST_ADD}, "[calc] fix: add"
    )
    with pytest.raises(SeriesError, match="differ from the patch's files"):
        load(
            _series(
                folder,
                commit,
                [
                    dict(
                        file=name,
                        title="t",
                        fix=True,
                        targets=["calc/other.py"],
                        new_tests=["tests/test_add_on_cpu.py"],
                    )
                ],
            )
        )
    with pytest.raises(SeriesError, match="must be files the patch adds"):
        load(
            _series(
                folder,
                commit,
                [
                    dict(
                        file=name,
                        title="t",
                        fix=True,
                        targets=["calc/__init__.py"],
                        new_tests=["tests/nope.py"],
                    )
                ],
            )
        )


def test_cli_bad_input_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "patches", "check", "--framework", "nosuchframework=/tmp"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no series for nosuchframework" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_table_lists_every_row():
    rows = [check.Row("verl", "0001-x.patch", "t", True, "FAIL 0/1 pass", "pass 1/1 pass", 1.0)]
    rows.append(check.Row("verl", "0002-y.patch", "t", False, problems=["does not apply"]))
    text = check.table(rows)
    assert "0001-x.patch" in text and "DEVIATION" in text and text.count("\n") == 3
    assert textwrap.dedent(text) == text


def test_python_runner_runs_each_test_file_as_a_script(calc):
    """slime's convention: CPU tests are run as ``python tests/<file>``; the exit status decides."""
    repo, commit, folder = calc
    script = "from calc import add\n\nif __name__ == '__main__':\n    assert add(2, 3) == 5\n"
    name = _patch(repo, folder, {"calc/__init__.py": FIXED, "tests/test_add_cpu.py": script}, "fix: add adds")
    entry = dict(
        file=name, title="t", fix=True, targets=["calc/__init__.py"], new_tests=["tests/test_add_cpu.py"]
    )
    rows = _run(_series(folder, commit, [entry], runner="python"), repo)
    assert [r.ok for r in rows] == [True, True], [r.problems for r in rows]
    assert rows[0].before == "FAIL rc=1" and rows[0].after == "pass rc=0"


def _with_sanity(series_path: Path, commands: list[str]) -> Path:
    """``series_path`` with ``sanity = commands`` in its [base] table."""
    text = series_path.read_text()
    listed = ", ".join(json.dumps(c) for c in commands)  # a JSON string is a TOML basic string
    series_path.write_text(text.replace('runner = "pytest"', f'runner = "pytest"\nsanity = [{listed}]', 1))
    return series_path


def test_sanity_commands_run_on_the_patched_tree_and_fail_loud(calc):
    """The project's own checks run after the series; ``{py_files}`` is what the series touched."""
    repo, commit, folder = calc
    sloppy = "import os\n\n\ndef add(a, b):\n    return a + b\n"  # ruff F401: unused import
    name = _patch(
        repo, folder, {"calc/__init__.py": sloppy, "tests/test_add_on_cpu.py": TEST_ADD}, "fix: add"
    )
    path = _fix_series(folder, commit, name, "tests/test_add_on_cpu.py")
    lists_files = "python -c \"import sys; print(sys.argv[1:]); sys.exit(sys.argv[1:] != ['calc/__init__.py', 'tests/test_add_on_cpu.py'])\" {py_files}"
    rows = _run(_with_sanity(path, [lists_files, "ruff check --no-cache --isolated {py_files}"]), repo)
    sanity = rows[-1]
    assert sanity.patch == "sanity" and sanity.after == "FAIL 1/2", sanity
    assert len(sanity.problems) == 1 and "ruff check" in sanity.problems[0] and "F401" in sanity.problems[0]


def test_sanity_commands_name_this_interpreters_tools():
    argv = check.sanity_argv("ruff check {py_files}", ["a.py", "b.py"])
    assert argv == [sys.executable, "-m", "ruff", "check", "a.py", "b.py"]
    assert check.sanity_argv("python x.py --d .", [])[:2] == [sys.executable, "x.py"]
    assert check.sanity_argv("git status", ["a.py"]) == ["git", "status"]


def _wheel(tmp: Path) -> Path:
    """A wheel of the buggy ``calc`` (as pip would download one; no upstream tests in it)."""
    import zipfile

    path = tmp / "calc-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("calc/__init__.py", "def add(a, b):\n    return a - b\n")
        wheel.writestr("calc-1.0.dist-info/METADATA", "Name: calc\nVersion: 1.0\n")
    return path


def test_a_wheel_base_puts_its_files_under_root_and_its_tests_find_them(tmp_path):
    # the patch is written against the upstream repository's layout: the package under python/
    upstream = tmp_path / "upstream"
    (upstream / "python" / "calc").mkdir(parents=True)
    (upstream / "python" / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    _git(upstream, "init", "-q")
    _git(upstream, "add", "-A")
    _git(upstream, "commit", "-qm", "base")
    folder = tmp_path / "patches" / "calc"
    folder.mkdir(parents=True)
    name = _patch(
        upstream, folder, {"python/calc/__init__.py": FIXED, "test/test_add.py": TEST_ADD}, "[calc] fix: add"
    )
    wheel = _wheel(tmp_path)
    lines = ["[base]", 'name = "calc 1.0 wheel"', 'wheel = "calc==1.0"', 'root = "python"']
    lines += ['pythonpath = ["python"]', f'sha256 = "{bases.sha256_of(wheel)}"', ""]
    lines += ["[[patch]]", f'file = "{name}"', 'title = "t"', "fix = true"]
    lines += ['targets = ["python/calc/__init__.py"]', 'new_tests = ["test/test_add.py"]']
    (folder / "series.toml").write_text("\n".join(lines) + "\n")
    series = load(folder / "series.toml")
    rows = check.check_series(series, str(wheel), log=lambda _m: None)
    assert [r.ok for r in rows] == [True, True], [r.problems for r in rows]
    assert rows[0].before.startswith("FAIL 0/1") and rows[0].after.startswith("pass 1/1")
    # another wheel than the one the series names is refused, as is a wheel for a git base
    other = tmp_path / "other" / wheel.name
    other.parent.mkdir()
    other.write_bytes(wheel.read_bytes() + b"\0")
    rows = check.check_series(series, str(other), log=lambda _m: None)
    assert rows[0].patch == "base" and "not the wheel the series names" in rows[0].problems[0]
    entry = dict(
        file=name, title="t", fix=True, targets=["python/calc/__init__.py"], new_tests=["test/test_add.py"]
    )
    rows = check.check_series(load(_series(folder, "HEAD", [entry])), str(wheel), log=lambda _m: None)
    assert rows[0].patch == "base" and "is a wheel" in rows[0].problems[0]


def test_wheel_only_keys_are_refused_elsewhere(calc):
    _repo, commit, folder = calc
    (folder / "p.patch").write_text("diff --git a/x b/x\n")
    text = f'[base]\nname = "c"\ngit = "l"\ncommit = "{commit}"\nroot = "python"\n'
    text += '[[patch]]\nfile = "p.patch"\ntitle = "t"\nfix = true\ntargets = []\nnew_tests = ["x"]\n'
    (folder / "series.toml").write_text(text)
    with pytest.raises(SeriesError, match="root = only goes with wheel ="):
        load(folder / "series.toml")
    (folder / "series.toml").write_text(text.replace('root = "python"', 'wheel = "c==1"'))
    with pytest.raises(SeriesError, match="exactly one of sdist =, wheel = or git ="):
        load(folder / "series.toml")


def _stack(repo: Path, out: Path, commits: list[tuple[dict[str, str], str]]) -> list[str]:
    """Commit each ``(files, message)`` on the one before, as format-patches in ``out``; HEAD is reset."""
    names = []
    for files, message in commits:
        for name, text in files.items():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(text)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", message)
        names.append(Path(_git(repo, "format-patch", "-1", "-o", str(out)).strip().splitlines()[-1]).name)
    _git(repo, "reset", "-q", "--hard", f"HEAD~{len(commits)}")
    return names


TEST_MUL = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
WITH_MUL = FIXED + "\n\ndef mul(a, b):\n    return a * b\n"


def _two_fixes(
    calc, monkeypatch, first: str, first_test: str, second_test: str = TEST_MUL
) -> tuple[list[check.Row], int]:
    """0001 (calc/__init__.py = ``first``, test ``first_test``), then 0002 adds ``mul``; the
    rows, and how many test runs the check started."""
    repo, commit, folder = calc
    names = _stack(
        repo,
        folder,
        [
            ({"calc/__init__.py": first, "tests/test_a_on_cpu.py": first_test}, "fix: add"),
            ({"calc/__init__.py": WITH_MUL, "tests/test_m_on_cpu.py": second_test}, "feat: mul"),
        ],
    )
    entries = [
        dict(file=n, title="t", fix=True, targets=["calc/__init__.py"], new_tests=[t])
        for n, t in zip(names, ["tests/test_a_on_cpu.py", "tests/test_m_on_cpu.py"], strict=True)
    ]
    started = []
    real = check.run_tests
    monkeypatch.setattr(check, "run_tests", lambda *a, **k: started.append(a[2]) or real(*a, **k))
    return _run(_series(folder, commit, entries), repo), len(started)


def test_one_run_gives_a_patch_its_after_and_the_next_its_before(calc, monkeypatch):
    """0001's after and 0002's before share a process (0002's test cannot even be imported yet:
    a collection error, which must not stop 0001's test); the last after shares the series run."""
    rows, runs = _two_fixes(calc, monkeypatch, FIXED, TEST_ADD)
    assert [r.ok for r in rows] == [True, True, True], [r.problems for r in rows]
    assert rows[0].before.startswith("FAIL 0/1") and rows[0].after == "pass 1/1 pass"
    assert rows[1].before.startswith("FAIL 0/1") and rows[1].after == "pass 1/1 pass"
    assert rows[2].after == "pass 2/2 pass"
    assert runs == 3  # before 0001; after 0001 + before 0002; after 0002 + series (was 5)


def test_a_shared_run_keeps_each_patchs_verdict_its_own(calc, monkeypatch):
    # 0001 does not fix add: its after fails, in the run where 0002's before fails as it should
    rows, _runs = _two_fixes(calc, monkeypatch, "def add(a, b):\n    return a - b + 0\n", TEST_ADD)
    assert rows[0].after.startswith("FAIL 0/1") and "fail after the patch" in rows[0].problems[0]
    assert rows[1].ok and rows[1].before.startswith("FAIL 0/1"), rows[1]
    # 0002's test passes before its patch: only 0002 is the deviation, 0001's after still passes
    trivial = "def test_nothing():\n    assert True\n"
    rows, _runs = _two_fixes(calc, monkeypatch, FIXED, TEST_ADD, second_test=trivial)
    assert rows[0].ok and rows[0].after == "pass 1/1 pass", rows[0]
    assert not rows[1].ok and "did not fail before" in rows[1].problems[0]


def test_a_case_is_counted_for_its_own_file_only():
    run = check.Run(1).count([("tests/a.py", "pass"), ("b.py", "fail"), ("", "skip"), ("", "fail")])
    owners = {f: check._owner(f, ["tests/a.py", "x/b.py"]) for f, _o in run.cases}
    assert owners == {"tests/a.py": "tests/a.py", "b.py": "x/b.py", "": None}
    a = check._part(run, ["tests/a.py"], owners)
    assert (a.tests, a.failures, a.rc) == (2, 1, 1)  # its pass, and the failure no file owns
    b = check._part(run, ["x/b.py"], owners)
    assert (b.tests, b.failures, b.rc) == (2, 2, 1)
    passing = check.Run(0).count([("tests/a.py", "pass")])
    assert check._part(passing, ["x/b.py"], {"tests/a.py": "tests/a.py"}).rc == 5  # nothing of its own ran
    crashed = check.Run(-9).count([("tests/a.py", "pass")])
    assert check._part(crashed, ["tests/a.py"], {"tests/a.py": "tests/a.py"}).rc == -9


EXIT_AFTER_REPORT = "import atexit, os, signal\n\n{hook}\n\n\ndef test_it():\n    assert {ok}\n"


@pytest.mark.parametrize(
    "hook, raw",
    [
        ("atexit.register(os._exit, 70)", 70),  # a library's exit hook ends the process
        ("atexit.register(lambda: os.kill(os.getpid(), signal.SIGKILL))", -9),  # killed at exit
    ],
)
def test_an_exit_status_after_the_report_is_judged_by_the_report(tmp_path, hook, raw):
    """pytest wrote its report and only then did the process end badly: the verdicts stand,
    and the raw status shows in the summary and the tail."""
    (tmp_path / "test_ok.py").write_text(EXIT_AFTER_REPORT.format(hook=hook, ok=True))
    (tmp_path / "test_bad.py").write_text(EXIT_AFTER_REPORT.format(hook=hook, ok=False))
    ok = check.run_tests(tmp_path, "pytest", ["test_ok.py"], {}, tmp_path)
    assert (ok.rc, ok.exit_rc, ok.tests, check._passed(ok)) == (0, raw, 1, True), ok.tail
    assert ok.summary == f"1/1 pass, exit {raw}" and f"exited with status {raw}" in ok.tail
    bad = check.run_tests(tmp_path, "pytest", ["test_bad.py"], {}, tmp_path)
    assert (bad.rc, bad.exit_rc, check._passed(bad)) == (1, raw, False), bad.tail


def test_a_process_that_dies_before_its_report_keeps_its_status(tmp_path):
    (tmp_path / "test_dies.py").write_text("import os\n\n\ndef test_it():\n    os._exit(70)\n")
    run = check.run_tests(tmp_path, "pytest", ["test_dies.py"], {}, tmp_path)
    assert (run.rc, run.exit_rc, run.tests, check._passed(run)) == (70, None, 0, False)


def test_stages_run_side_by_side_in_worktrees_with_the_same_verdicts(calc, monkeypatch, tmp_path):
    """Two jobs: the series run (the last tree) and 0001's before (the base) start together,
    each in its own tree; the verdicts are those of one run at a time, and no worktree is
    left behind."""
    from patches import stages

    monkeypatch.setenv(stages.JOBS_ENV, "2")
    spans: list[tuple[float, float, Path, bool]] = []
    real = check.run_tests

    def timed(tree, *a, **k):
        start = time.monotonic()
        present = (Path(tree) / "calc" / "__init__.py").is_file()
        try:
            return real(tree, *a, **k)
        finally:
            spans.append((start, time.monotonic(), Path(tree), present))

    monkeypatch.setattr(check, "run_tests", timed)
    repo, commit, folder = calc
    names = _stack(
        repo,
        folder,
        [
            ({"calc/__init__.py": FIXED, "tests/test_a_on_cpu.py": TEST_ADD}, "fix: add"),
            ({"calc/__init__.py": WITH_MUL, "tests/test_m_on_cpu.py": TEST_MUL}, "feat: mul"),
        ],
    )
    entries = [
        dict(file=n, title="t", fix=True, targets=["calc/__init__.py"], new_tests=[t])
        for n, t in zip(names, ["tests/test_a_on_cpu.py", "tests/test_m_on_cpu.py"], strict=True)
    ]
    keep = tmp_path / "keep"
    rows = check.check_series(
        load(_series(folder, commit, entries)), str(repo), keep=keep, log=lambda _m: None
    )
    assert [r.ok for r in rows] == [True, True, True], [r.problems for r in rows]
    assert [(r.before[:8], r.after) for r in rows[:2]] == [("FAIL 0/1", "pass 1/1 pass")] * 2
    assert rows[2].after == "pass 2/2 pass"
    assert sorted(p.name for _s, _e, p, _ok in spans) == ["stage-0", "stage-1", "tree"]
    assert all(ok for *_r, ok in spans)  # each ran in a full checkout
    (first, second) = sorted(spans)[:2]
    assert second[0] < first[1], spans  # the second started before the first ended
    assert not list(keep.glob("stage-*")), list(keep.iterdir())
    listed = _git(keep / "tree", "worktree", "list").strip().splitlines()
    assert len(listed) == 1, listed
