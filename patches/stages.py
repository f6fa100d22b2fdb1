"""The test runs of a series check, as independent stages that can run side by side.

Once the series is committed in order on the base (commit ``c_k`` = the base with patches
1..k), every verdict needs one of these trees:

- stage ``k`` runs on ``c_k``: patch k's ``after`` (its new tests, k >= 1), patch k+1's
  ``before`` (that patch's new test files added with ``git apply --include``, a fix only), and
  on the last commit of a fully applied series the ``series`` run (all new and upstream tests).

A stage's tree never changes while it runs, and no stage reads another's result, so stages
run in parallel (``jobs`` at a time), each in its own ``git worktree`` of the check's tree;
the stage on the last commit runs in the tree itself (the sanity commands run there after
it, as they did when the stages ran in turn). Start-up (imports of torch, vLLM, the trainer
stack) is most of a pytest run and is CPU-bound, so ``jobs`` beyond the CPU count gains
nothing; the default is :func:`default_jobs`.

Invariants: each stage is exactly the tree the sequential check used for the same runs (the
same commit, the same added test files, a fresh checkout); a stage's worktree is removed
when the stage ends, whatever its result; results come back in stage order, so rows and log
lines do not depend on which stage finished first; the longest stage (the series run) starts
first.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from patches import base as bases
from patches.series import Patch

JOBS_ENV = "MODAL_RL_PATCHES_JOBS"
MAX_DEFAULT_JOBS = 2  # each stage's pytest holds torch + vLLM (1-2 GiB), a Ray-backed one more


def default_jobs() -> int:
    """``$MODAL_RL_PATCHES_JOBS``, else the CPU count capped at :data:`MAX_DEFAULT_JOBS`."""
    raw = os.environ.get(JOBS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{JOBS_ENV}={raw!r}: give a whole number of parallel test runs, 1 or more")
        return int(raw)
    return max(1, min(MAX_DEFAULT_JOBS, os.cpu_count() or 1))


@dataclass
class Group:
    """One verdict's test files within a stage: ``kind`` is "after", "before" or "series";
    ``patch`` the index of the patch it judges (-1 for the series run)."""

    kind: str
    patch: int
    files: list[str]


@dataclass
class Stage:
    index: int  # k: the tree is the base with the first k patches committed
    commit: str
    include: Patch | None = None  # the patch whose new test files are added (its 'before')
    groups: list[Group] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the stage's runs


def plan(patches: tuple[Patch, ...], commits: list[str], attempted: int, series_files: list[str] | None):
    """The stages for ``commits`` (``commits[k]`` = base + k patches); ``attempted`` patches
    were tried (the last one may not apply); ``series_files`` when the whole series applied."""
    stages = []
    for k, commit in enumerate(commits):
        stage = Stage(k, commit)
        if k >= 1:
            stage.groups.append(Group("after", k - 1, list(patches[k - 1].new_tests)))
        if k < attempted and patches[k].fix:
            stage.include = patches[k]
            stage.groups.append(Group("before", k, list(patches[k].new_tests)))
        if series_files is not None and k == len(patches):
            stage.groups.append(Group("series", -1, series_files))
        if stage.groups:
            stages.append(stage)
    return stages


def run_all(tree: Path, stages: list[Stage], run_groups, scratch: Path, jobs: int, log=None) -> list[list]:
    """Each stage's runs (``run_groups(where, [files per group])``), in stage order; stages
    on earlier commits run in worktrees under ``scratch``, the last one in ``tree``. ``log``
    gets a line as each stage ends (in the order they end)."""
    head = bases.git(tree, "rev-parse", "HEAD").stdout.strip()
    lock = threading.Lock()  # one git command at a time on the shared repository metadata

    def one(stage: Stage) -> list:
        in_tree = stage.commit == head and stage is stages[-1]
        where = tree if in_tree else scratch / f"stage-{stage.index}"
        if not in_tree:
            with lock:
                bases.git(tree, "worktree", "add", "-q", "--detach", str(where), stage.commit)
        started = time.monotonic()
        try:
            if stage.include is not None:
                include = [arg for t in stage.include.new_tests for arg in ("--include", t)]
                bases.git(where, "apply", *include, str(stage.include.file))
            return run_groups(where, [g.files for g in stage.groups])
        finally:
            stage.seconds = time.monotonic() - started
            if log is not None:
                runs = ", ".join(
                    f"{g.kind} {g.patch + 1:04d}" if g.patch >= 0 else g.kind for g in stage.groups
                )
                log(f"[patches] tree {stage.index} ({runs}) done in {stage.seconds:.0f} s")
            if not in_tree:
                with lock:
                    bases.git(tree, "worktree", "remove", "--force", str(where), check=False)
            elif stage.include is not None:
                bases.git(tree, "reset", "-q", "--hard")
                bases.git(tree, "clean", "-q", "-fdx")

    # The last stage holds the series run, the longest: started first, it does not end alone.
    order = [*stages[-1:], *stages[:-1]]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {id(s): pool.submit(one, s) for s in order}
        results = [futures[id(s)].result() for s in stages]
    bases.git(tree, "worktree", "prune", check=False)
    return results
