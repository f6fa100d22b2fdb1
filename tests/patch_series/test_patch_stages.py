"""The stages of a series check (``patches/stages.py``): which runs need which tree, and how
many run side by side. The runs themselves (real pytest in worktrees, side by side) are
checked in tests/e2e/test_patches_check.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from patches import stages
from patches.__main__ import main
from patches.series import Patch


def _patch(n: int, fix: bool = True) -> Patch:
    return Patch(Path(f"{n:04d}-p.patch"), "t", fix, (), (f"tests/test_{n}_on_cpu.py",))


def _shape(plan: list[stages.Stage]) -> list[tuple[int, list[tuple[str, int]]]]:
    return [(s.index, [(g.kind, g.patch) for g in s.groups]) for s in plan]


def test_each_tree_carries_the_after_of_its_last_patch_and_the_before_of_the_next():
    patches = (_patch(1), _patch(2), _patch(3))
    plan = stages.plan(patches, ["c0", "c1", "c2", "c3"], attempted=3, series_files=["all.py"])
    assert _shape(plan) == [
        (0, [("before", 0)]),
        (1, [("after", 0), ("before", 1)]),
        (2, [("after", 1), ("before", 2)]),
        (3, [("after", 2), ("series", -1)]),
    ]
    assert [s.commit for s in plan] == ["c0", "c1", "c2", "c3"]
    assert [s.include for s in plan] == [patches[0], patches[1], patches[2], None]
    assert plan[-1].groups[-1].files == ["all.py"]


def test_a_patch_that_is_no_fix_has_no_before_and_one_that_does_not_apply_still_has_its_before():
    patches = (_patch(1, fix=False), _patch(2), _patch(3), _patch(4))
    # 0003 did not apply: the trees are the base, +0001 and +0002; no series run
    plan = stages.plan(patches, ["c0", "c1", "c2"], attempted=3, series_files=None)
    assert _shape(plan) == [(1, [("after", 0), ("before", 1)]), (2, [("after", 1), ("before", 2)])]
    assert plan[-1].include is patches[2]
    # the first patch does not apply and is no fix: nothing to run
    assert stages.plan(patches, ["c0"], attempted=1, series_files=None) == []


def test_jobs_come_from_the_environment_or_the_cpu_count(monkeypatch):
    monkeypatch.delenv(stages.JOBS_ENV, raising=False)
    monkeypatch.setattr(stages.os, "cpu_count", lambda: 16)
    assert stages.default_jobs() == stages.MAX_DEFAULT_JOBS
    monkeypatch.setattr(stages.os, "cpu_count", lambda: 1)
    assert stages.default_jobs() == 1
    monkeypatch.setenv(stages.JOBS_ENV, "3")
    assert stages.default_jobs() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(stages.JOBS_ENV, bad)
        with pytest.raises(ValueError, match=f"{stages.JOBS_ENV}=.*whole number"):
            stages.default_jobs()


@pytest.mark.parametrize(
    "argv, env, line",
    [
        (["--jobs", "0"], None, "patches: --jobs must be 1 or more"),
        ([], "many", f"patches: {stages.JOBS_ENV}='many': give a whole number"),
    ],
)
def test_bad_jobs_are_one_line_and_exit_2(monkeypatch, capsys, argv, env, line):
    if env is None:
        monkeypatch.delenv(stages.JOBS_ENV, raising=False)
    else:
        monkeypatch.setenv(stages.JOBS_ENV, env)
    assert main(["check", "--verl", "sdist", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err
