"""One framework's patch series: ``patches/<framework>/series.toml`` parsed and checked.

The file format (shared by every framework; see ``patches/README.md``)::

    [base]
    name = "verl 0.9.1 sdist"          # what the patches apply to, for people
    sdist = "verl==0.9.1"              # a source distribution on the package index, or
    wheel = "sglang==0.5.23"           # a wheel on the package index (its Python source), or
    git = "https://github.com/THUDM/slime"   # a git repository (a DIR must be given)
    commit = "624b824a8"               # with git: the commit the series applies to
    sha256 = "..."                     # optional, with sdist or wheel: the archive's digest
    root = "python"                    # optional, with wheel: the folder the wheel's files go
                                       #   in, so patches use the upstream repository's paths
    pythonpath = ["python"]            # optional: tree folders put first on PYTHONPATH for tests
    version_file = "verl/version/version"    # optional: a file in the tree that must hold
    version = "0.9.1"                  #   this text (checked on a DIR that is not git)
    runner = "pytest"                  # "pytest" (python -m pytest FILES) or "python" (python FILE)
    env = { VERL_USE_EXTERNAL_PLUGINS = "none" }   # optional, for every test run
    sanity = ["python tests/special_sanity/check_license.py --directories .",
              "ruff check {py_files}"]  # optional: the project's own checks, on the patched tree

    [[patch]]
    file = "0001-....patch"            # next to series.toml, `git format-patch` form
    title = "[trainer] fix: ..."       # the upstream PR title
    fix = true                         # a fix: its new tests must fail before and pass after
    targets = ["verl/..."]             # the files the patch changes (checked against the patch)
    new_tests = ["tests/..._on_cpu.py"]
    upstream_tests = ["tests/..."]     # upstream's own tests to run after the series
    upstream_tests_full = []           # slower upstream tests, run with --full only
    answers = "verl #2515"             # the upstream issue / symptom it answers

Invariants: every listed file exists next to the series; a patch's ``new_tests`` are among
the files the patch adds or changes and its ``targets`` are exactly the other files it
changes; ``runner`` is one of :data:`RUNNERS`; a base has exactly one of ``sdist``,
``wheel``, ``git``; ``root`` and ``pythonpath`` name folders inside the tree. A violation is one :class:`SeriesError` line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

RUNNERS = ("pytest", "python")
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


class SeriesError(ValueError):
    """A series file that cannot be used as written; the message names the file and the fix."""


@dataclass(frozen=True)
class Base:
    name: str
    sdist: str | None = None
    wheel: str | None = None
    git: str | None = None
    commit: str | None = None
    sha256: str | None = None
    version_file: str | None = None
    version: str | None = None
    runner: str = "pytest"
    env: dict[str, str] = field(default_factory=dict)
    sanity: tuple[str, ...] = ()
    root: str = ""
    pythonpath: tuple[str, ...] = ()

    @property
    def archive(self) -> str | None:
        """The ``name==version`` fetched from the package index (sdist or wheel), if any."""
        return self.sdist or self.wheel


@dataclass(frozen=True)
class Patch:
    file: Path
    title: str
    fix: bool
    targets: tuple[str, ...]
    new_tests: tuple[str, ...]
    upstream_tests: tuple[str, ...] = ()
    upstream_tests_full: tuple[str, ...] = ()
    answers: str = ""

    @property
    def label(self) -> str:
        return self.file.name.split("-", 1)[0]


@dataclass(frozen=True)
class Series:
    framework: str
    path: Path
    base: Base
    patches: tuple[Patch, ...]


def changed_files(patch_text: str) -> list[str]:
    """The paths a ``git format-patch`` file changes, in order."""
    return [b for _a, b in _DIFF_FILE.findall(patch_text)]


def _strs(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SeriesError(f"{where} must be a list of strings")
    return tuple(value)


def load(path: Path) -> Series:
    """Parse and check ``path`` (a ``series.toml``)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SeriesError(f"{path}: cannot read the series ({exc}); fix the file") from None
    raw = data.get("base")
    if not isinstance(raw, dict) or "name" not in raw:
        raise SeriesError(f"{path}: needs a [base] table with a name")
    for key in ("sanity", "pythonpath"):
        if key in raw:
            raw = {**raw, key: _strs(raw[key], f"{path}: [base] {key}")}
    base = Base(**{k: v for k, v in raw.items() if k in Base.__dataclass_fields__})
    unknown = set(raw) - set(Base.__dataclass_fields__)
    if unknown:
        raise SeriesError(f"{path}: unknown [base] keys {sorted(unknown)}")
    if base.runner not in RUNNERS:
        raise SeriesError(f"{path}: [base] runner must be one of {RUNNERS}, not {base.runner!r}")
    if sum(bool(x) for x in (base.sdist, base.wheel, base.git)) != 1:
        raise SeriesError(f"{path}: [base] needs exactly one of sdist =, wheel = or git =")
    if base.root and not base.wheel:
        raise SeriesError(f"{path}: [base] root = only goes with wheel =")
    for folder in (base.root, *base.pythonpath):
        if Path(folder).is_absolute() or ".." in Path(folder).parts:
            raise SeriesError(f"{path}: [base] {folder!r} must be a folder inside the tree")
    patches = []
    for i, entry in enumerate(data.get("patch", [])):
        where = f"{path}: [[patch]] #{i + 1}"
        missing = {"file", "title", "fix", "targets", "new_tests"} - set(entry)
        if missing:
            raise SeriesError(f"{where} lacks {sorted(missing)}")
        file = path.parent / entry["file"]
        if not file.is_file():
            raise SeriesError(f"{where}: {file} does not exist")
        patch = Patch(
            file=file,
            title=str(entry["title"]),
            fix=bool(entry["fix"]),
            targets=_strs(entry["targets"], f"{where} targets"),
            new_tests=_strs(entry["new_tests"], f"{where} new_tests"),
            upstream_tests=_strs(entry.get("upstream_tests", []), f"{where} upstream_tests"),
            upstream_tests_full=_strs(entry.get("upstream_tests_full", []), f"{where} upstream_tests_full"),
            answers=str(entry.get("answers", "")),
        )
        changed = changed_files(file.read_text())
        if not patch.new_tests or not set(patch.new_tests) <= set(changed):
            raise SeriesError(f"{where}: new_tests {list(patch.new_tests)} must be files the patch adds")
        others = sorted(set(changed) - set(patch.new_tests))
        if sorted(patch.targets) != others:
            raise SeriesError(
                f"{where}: targets {sorted(patch.targets)} differ from the patch's files {others}"
            )
        patches.append(patch)
    if not patches:
        raise SeriesError(f"{path}: no [[patch]] entries")
    return Series(framework=path.parent.name, path=path, base=base, patches=tuple(patches))
