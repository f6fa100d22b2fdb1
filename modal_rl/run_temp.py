"""Per-run temp directories: where the processes a run starts write their temp files.

vLLM (ZMQ ipc sockets named by a bare UUID, ``vllm_dist_*`` rendezvous files), torch
(``pymp-*``), Ray (its session dir, ``<temp>/ray``) and lock-file users all write under the
temp directory they find in ``TMPDIR`` (Python's ``tempfile``, vLLM's ``VLLM_RPC_BASE_PATH``
default, Ray's ``get_default_system_temp_dir``) and leave their files behind when a process
is killed rather than asked to exit. So every place where our code starts such processes
gives them ``TMPDIR`` pointing into a directory the run owns, and removes that directory when
the run ends.

Invariants:
- a run dir is ``<temp>/mrl-<tag><random>``, short on purpose: unix socket paths under it
  (Ray's ``<dir>/ray/session_<time>/sockets/...``, vLLM's ``<dir>/<uuid>``) must stay under
  107 bytes; a ``TMPDIR`` longer than :data:`MAX_BASE_LEN` is passed over for the base its
  run dir was made in (a process started inside a run: :data:`BASE_ENV`), else for ``/tmp``;
- the owner removes it when the run ends (return, exception, Ctrl-C), and at this process's
  exit as a backstop (``atexit``); only a SIGKILLed owner leaves it behind, and the next run
  removes that one: each run dir holds an owner mark (``OWNER_FILE``: the owner's PID and its
  start time in clock ticks, so a reused PID is not mistaken for it), and the first run dir a
  process makes or owns sweeps ``<base>/mrl-*`` of every dir whose owner is gone
  (:func:`sweep`). A dir without a mark (being made, kept with ``MODAL_RL_KEEP_LOGS``, or
  made by a shell script without one) is never swept;
- shared hosts: a run dir is 0700 (``mkdtemp``, or ``private_dir`` for a named one, which
  refuses a directory of that name made by another user, or a link); its owner mark is
  written ``O_NOFOLLOW|O_EXCL``; ``sweep`` looks only at this user's dirs;
- ``MODAL_RL_KEEP_LOGS`` set keeps it (its Ray session logs and engine logs), as the local
  cluster backend always did for its own temp root;
- a variable the user set on purpose (``RAY_TMPDIR``, ``VLLM_RPC_BASE_PATH``,
  ``TORCHINDUCTOR_CACHE_DIR``) is left alone: only ``TMPDIR`` is replaced;
- caches are not temp files: torch's compiled-kernel cache (vLLM compiles a few sampler
  kernels even with ``--enforce-eager``) defaults to ``<temp>/torchinductor_<user>``, which a
  fresh run dir would empty every run (a recompile, ~10 s per engine on a small CPU), so it
  goes to the user's cache dir (``$XDG_CACHE_HOME`` or ``~/.cache``, ``modal-rl/torchinductor``),
  beside vLLM's and Hugging Face's own caches.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "mrl-"
TEMP_ENV = "TMPDIR"
KERNEL_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
KEEP_ENV = "MODAL_RL_KEEP_LOGS"
BASE_ENV = "MODAL_RL_TEMP_BASE"
OWNER_FILE = ".mrl-owner"
# Room for the deepest socket path under a run dir (nested in another run's, too):
# <base>/mrl-<12>/r0/session_<date>_<time>_<us>_<pid>/sockets/plasma_store is ~80 bytes + base.
MAX_BASE_LEN = 20
_owned: set[str] = set()
_swept = False


@atexit.register
def _remove_owned() -> None:
    for path in list(_owned):
        remove(path)


def base_dir() -> str:
    """Where run dirs are made: the temp directory, unless its path is too long for sockets;
    then the base the run dir this process runs in was made in (:data:`BASE_ENV`, set by
    :func:`child_env`: a run dir is one level longer than its base, so a process whose
    ``TMPDIR`` is a run dir, a Ray worker of a launcher's run, makes its own beside it rather
    than in ``/tmp``), else ``/tmp``."""
    where = tempfile.gettempdir()
    if len(where) <= MAX_BASE_LEN or not os.path.isdir("/tmp"):
        return where
    inherited = os.environ.get(BASE_ENV, "")
    if inherited and len(inherited) <= MAX_BASE_LEN and os.path.isdir(inherited):
        return inherited
    return "/tmp"


def make(tag: str = "") -> Path:
    """A fresh run dir ``<temp>/mrl-<tag><random>``, owned by this process until :func:`remove`."""
    _sweep_once()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{tag}", dir=base_dir())
    _owned.add(path)
    _mark(path)
    return Path(path)


def owner_token(pid: int) -> str | None:
    """``"<pid> <start time>"`` of a live process, None if there is none with that PID. The
    start time tells a reused PID from the process that wrote a marker."""
    import psutil

    try:
        return f"{pid} {psutil.Process(pid).create_time():.2f}"
    except (psutil.Error, ValueError):
        return None


class ForeignDirError(PermissionError):
    """A directory this user must own (a run dir, a lock dir) belongs to another user, or is a
    link; the message is one line with the fix."""


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory only this user can use: made 0700 when missing; an existing one
    must be a real directory (not a link) owned by this user, and is narrowed to 0700.
    ``ForeignDirError`` otherwise: on a shared host another user may have made it first, to
    read what the run writes there or to plant links in it."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = "not a directory" if not stat.S_ISDIR(st.st_mode) else f"owned by uid {st.st_uid}"
        raise ForeignDirError(
            f"refusing {path}: {what}, not this user's (uid {os.getuid()}); remove it, or point "
            "TMPDIR at a directory of your own"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _mark(path: str | os.PathLike) -> None:
    """Write the owner mark: never through a link planted at its name (``O_NOFOLLOW``), and
    only as a new file (``O_EXCL``: a stale mark of ours is unlinked first, which never follows)."""
    token = owner_token(os.getpid())
    if token is None:
        return
    mark = Path(path, OWNER_FILE)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(mark)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(OSError):
        fd = os.open(mark, flags, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")


def owner_gone(path: str | os.PathLike) -> bool:
    """True when ``path`` has an owner mark and that process no longer exists."""
    try:
        token = Path(path, OWNER_FILE).read_text().strip()
        pid = int(token.split()[0])
    except (OSError, ValueError, IndexError):
        return False  # no mark (or unreadable): not ours to judge
    return owner_token(pid) != token


def sweep(where: str | None = None) -> list[str]:
    """Remove every ``mrl-*`` run dir under ``where`` (default :func:`base_dir`) whose owner
    process is gone (a SIGKILLed run's); returns their paths. Never raises."""
    removed = []
    try:
        entries = list(Path(where or base_dir()).glob(f"{PREFIX}*"))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        try:
            mine = entry.lstat().st_uid == uid  # another user's run dirs are theirs to sweep
        except OSError:
            continue
        if (
            mine
            and str(entry) not in _owned
            and entry.is_dir()
            and not entry.is_symlink()
            and owner_gone(entry)
        ):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def _sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        sweep()


def named(unique: str) -> Path:
    """The path of run dir ``<temp>/mrl-<unique>``, not made yet (:func:`own` makes it): for an
    owner that needs the name before it starts anything (a pool never started makes none)."""
    return Path(base_dir(), f"{PREFIX}{unique}")


def own(path: str | os.PathLike) -> Path:
    """Make ``path`` (again) and own it: a run dir that :func:`remove` took, reused."""
    _sweep_once()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    private_dir(path)  # 0700; refused when another user made it first (the name is predictable)
    _owned.add(str(path))
    _mark(path)
    return Path(path)


def keep() -> bool:
    """True when the user asked to keep run dirs (``MODAL_RL_KEEP_LOGS``)."""
    return bool(os.environ.get(KEEP_ENV))


def remove(path: str | os.PathLike) -> None:
    """Remove a run dir (and forget it), unless :func:`keep`; never raises."""
    path = str(path)
    _owned.discard(path)
    if not keep():
        shutil.rmtree(path, ignore_errors=True)
    else:  # kept on purpose: no sweep may take it
        with contextlib.suppress(OSError):
            Path(path, OWNER_FILE).unlink()


def kernel_cache_dir() -> str:
    """Where compiled kernels are cached across runs (the module docstring says why)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "modal-rl", "torchinductor")


def use_kernel_cache() -> str:
    """This process (and what it starts) caches compiled kernels in :func:`kernel_cache_dir`
    unless ``TORCHINDUCTOR_CACHE_DIR`` names a place. Call it before vLLM is imported: ``import
    vllm`` fixes the cache dir for the process, making ``<temp>/torchinductor_<user>``."""
    return os.environ.setdefault(KERNEL_CACHE_ENV, kernel_cache_dir())


def child_env(path: str | os.PathLike) -> dict[str, str]:
    """The environment entries that send a child's temp files into ``path`` (and its kernel
    cache to :func:`kernel_cache_dir`, unless the user named one); ``path``'s parent, the base
    it was made in, is :data:`BASE_ENV`, where the child makes run dirs of its own when
    ``path`` is too long to hold them (:func:`base_dir`)."""
    return {
        TEMP_ENV: str(path),
        KERNEL_CACHE_ENV: os.environ.get(KERNEL_CACHE_ENV) or kernel_cache_dir(),
        BASE_ENV: str(Path(path).parent),
    }


@contextlib.contextmanager
def process_temp(tag: str = "") -> Iterator[Path]:
    """This process and everything it starts inside the block use a fresh run dir as their
    temp directory (``TMPDIR`` and ``tempfile``'s cache); both are restored and the dir is
    removed when the block ends, however it ends."""
    path = make(tag)
    entries = child_env(path)
    saved_env = {name: os.environ.get(name) for name in entries}
    saved_cache = tempfile.tempdir
    os.environ.update(entries)
    tempfile.tempdir = str(path)
    try:
        yield path
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = saved_cache
        remove(path)
        if len(str(path)) > MAX_BASE_LEN:
            # the children made their run dirs beside this one (``base_dir``); those whose
            # owner died without removing them (a Ray worker killed at shutdown) go now, not
            # at the next run's sweep
            sweep(str(Path(path).parent))
