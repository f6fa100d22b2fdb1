"""A clean, committed copy of a series' base in a scratch directory.

Sources, by what ``DIR`` is:
- ``"sdist"``/``"wheel"`` (or nothing) with an ``sdist =`` base: the archive from the package
  index, by ``pip download --no-binary :all: --no-deps``, cached in :func:`cache_dir`; with a
  ``wheel =`` base: the wheel for this interpreter (``--only-binary :all:``), likewise;
- a ``.tar.gz`` file: that archive; a ``.whl`` file: that wheel (a wheel base only);
- a git checkout (or bare git dir): a clone at the base's ``commit`` (HEAD without one), so
  local edits and untracked files in ``DIR`` never reach the copy;
- any other directory (an unpacked sdist): a copy, checked against ``version_file``.

Invariants: the copy is a git repository with exactly one commit holding the base, so a
patch's effect is ``git diff`` against it; ``DIR`` itself is never written; an archive whose
digest differs from the series' ``sha256`` is refused; a wheel's files land under the
base's ``root`` (e.g. ``python/``, where SGLang's repository keeps its package), so a patch
written against the upstream repository applies to the wheel's copy of the same files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from patches.series import Base

CACHE_ENV = "MODAL_RL_PATCHES_CACHE"
GIT_ID = {
    "GIT_AUTHOR_NAME": "patches check",
    "GIT_AUTHOR_EMAIL": "patches-check@localhost",
    "GIT_COMMITTER_NAME": "patches check",
    "GIT_COMMITTER_EMAIL": "patches-check@localhost",
}


class BaseError(RuntimeError):
    """The base could not be obtained or is not the one the series names (message says why)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "modal-rl" / "patches")


def git(tree: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``git -C tree args`` with a fixed identity; output captured."""
    proc = subprocess.run(
        ["git", "-c", "safe.directory=*", "-C", str(tree), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_ID},
    )
    if check and proc.returncode != 0:
        raise BaseError(
            f"git {' '.join(args)} failed in {tree}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def download_sdist(requirement: str, sha256: str | None = None, *, kind: str = "sdist") -> Path:
    """The ``kind`` archive (``"sdist"`` or ``"wheel"``) for ``requirement`` (``name==version``),
    downloaded once into the cache."""
    name, _, version = requirement.partition("==")
    if not version:
        raise BaseError(f"{kind} = {requirement!r} must pin a version (name==version)")
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stem = (
        f"{name.replace('-', '_')}-{version}-" if kind == "wheel" else f"{name.replace('-', '_')}-{version}"
    )
    suffix, only = ("*.whl", "--only-binary") if kind == "wheel" else ("*.tar.gz", "--no-binary")
    found = [p for p in folder.glob(suffix) if p.name.lower().startswith(stem.lower())]
    if not found:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", only, ":all:"]
        argv += ["--quiet", "--disable-pip-version-check", "-d", str(folder), requirement]
        proc = subprocess.run(argv, capture_output=True, text=True)
        found = [p for p in folder.glob(suffix) if p.name.lower().startswith(stem.lower())]
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no archive"]
            raise BaseError(f"could not download the {requirement} {kind} from the package index: {tail[0]}")
    archive = found[0]
    if sha256 and sha256_of(archive) != sha256:
        raise BaseError(f"{archive} has sha256 {sha256_of(archive)}, the series expects {sha256}; delete it")
    return archive


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _unpack(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")  # no owners, no paths outside `into`
    tops = [p for p in into.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise BaseError(f"{archive} does not unpack to one top directory")
    return tops[0]


def _commit_all(tree: Path, message: str) -> None:
    git(tree, "init", "-q")
    git(tree, "add", "-A", "-f", ".")
    git(tree, "commit", "-q", "--no-verify", "-m", message)


def _is_git(path: Path) -> bool:
    return git(path, "rev-parse", "--git-dir", check=False).returncode == 0 and (
        (path / ".git").exists() or (path / "HEAD").is_file()
    )


def prepare(base: Base, source: str | None, scratch: Path) -> Path:
    """A clean copy of ``base`` from ``source`` (see the module doc) under ``scratch``."""
    scratch.mkdir(parents=True, exist_ok=True)
    if source in (None, "", "sdist", "wheel"):
        if not base.archive:
            raise BaseError(f"{base.name}: give a DIR (a checkout of {base.git} at {base.commit})")
        kind = "wheel" if base.wheel else "sdist"
        return _from_archive(base, download_sdist(base.archive, base.sha256, kind=kind), scratch)
    path = Path(source).expanduser()
    if path.is_file() and path.name.endswith(".whl"):
        if not base.wheel:
            raise BaseError(f"{path} is a wheel; {base.name} is not a wheel = base")
        if base.sha256 and sha256_of(path) != base.sha256:
            raise BaseError(f"{path} is not the wheel the series names (sha256 {base.sha256})")
        return _from_archive(base, path, scratch)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        if base.sha256 and sha256_of(path) != base.sha256:
            raise BaseError(f"{path} is not the archive the series names (sha256 {base.sha256})")
        return _from_archive(base, path, scratch)
    if not path.is_dir():
        raise BaseError(f"{path} is neither a directory nor a .tar.gz archive")
    if _is_git(path):
        tree = scratch / "tree"
        proc = subprocess.run(
            ["git", "-c", "safe.directory=*", "clone", "-q", "--no-checkout", str(path), str(tree)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise BaseError(f"cannot clone {path}: {proc.stderr.strip()}")
        ref = base.commit or "HEAD"
        if git(tree, "checkout", "-q", "--detach", ref, check=False).returncode != 0:
            raise BaseError(f"{path} does not have commit {ref} of {base.name}; fetch it there first")
        _check_version(base, tree, path)
        return tree
    tree = scratch / "tree"
    shutil.copytree(path, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"), symlinks=True)
    _check_version(base, tree, path)
    _commit_all(tree, f"base: {base.name}")
    return tree


def _from_archive(base: Base, archive: Path, scratch: Path) -> Path:
    if archive.name.endswith(".whl"):
        tree = scratch / "tree"
        with zipfile.ZipFile(archive) as wheel:
            _extract_wheel(wheel, tree / base.root if base.root else tree)
        _check_version(base, tree, archive)
        _commit_all(tree, f"base: {base.name} ({archive.name})")
        return tree
    tree = _unpack(archive, scratch / "unpacked")
    _check_version(base, tree, archive)
    _commit_all(tree, f"base: {base.name} ({archive.name})")
    return tree


def _extract_wheel(wheel: zipfile.ZipFile, into: Path) -> None:
    """The wheel's files under ``into``; a member naming a path outside it is refused."""
    into.mkdir(parents=True, exist_ok=True)
    top = into.resolve()
    for member in wheel.namelist():
        target = (into / member).resolve()
        if not target.is_relative_to(top):
            raise BaseError(f"wheel member {member!r} points outside the tree; not unpacking it")
    wheel.extractall(into)


def _check_version(base: Base, tree: Path, origin: Path) -> None:
    if not (base.version_file and base.version):
        return
    file = tree / base.version_file
    found = file.read_text().strip() if file.is_file() else None
    if found != base.version:
        raise BaseError(f"{origin} is {base.version_file}={found!r}, not {base.name} ({base.version})")
