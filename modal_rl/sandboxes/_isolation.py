"""How the test runner starts the program so that the program can never reach it (stdlib only).

The program process gets, in this order (``start``; each step before any program code runs):
- a parent-death signal: it dies with the runner;
- another uid where the runner may set one (a sandbox that gives it root: Modal's);
- a user, PID, mount and IPC namespace of its own below the runner's (where the kernel allows
  it: the local provider's execs map their user namespace for this): its uid is ``nobody``
  there and it holds no capability over the runner's namespaces; it is PID 1 of its own PID
  namespace, so the runner has no pid it could signal, and when it exits the kernel kills
  everything it started; a fresh tmpfs over the work dir and /tmp hides whatever the runner
  writes (pytest's copy of the test file), and a fresh /proc where the kernel allows one;
- no file descriptor but its socket and a copy of stderr (stdin is /dev/null, stdout goes to
  stderr): not the runner's stdin (where the tests wait, unread, when it forks), not the report.
The runner itself is non-dumpable (``make_undumpable``): with either of the first two, no
process of the program can open its memory, its file descriptors or its environment. If neither
another uid nor the namespaces can be had, ``start`` raises ``IsolationError`` and no program runs.
"""

import contextlib
import ctypes
import errno
import os
import signal
import socket

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
NOBODY = 65534
_TMPFS_OPTS = b"mode=0700,size=256m"
_libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(RuntimeError):
    """The program cannot be kept out of the runner's reach here: nothing is run."""


def make_undumpable():
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _fail(what):
    err = ctypes.get_errno()
    return f"{what}: {os.strerror(err)}"


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _drop_uid():
    """Another uid (and no groups) where the runner may set one; False where it may not."""
    if os.geteuid() != 0:
        return False
    try:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    except OSError:
        return False
    return True


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities():
    """No capability left, and none to regain: bounding set, ambient set, then the sets themselves."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the kernel's last capability
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    if _libc.capset(ctypes.byref(header), (_CapData * 2)()) != 0:
        raise IsolationError(_fail("cannot drop the program's capabilities (capset)"))
    with open("/proc/self/status") as f:
        held = {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
    if int(held.get("CapEff", "1"), 16) or int(held.get("CapPrm", "1"), 16):
        raise IsolationError("the program process still holds capabilities")


def _mount_tmpfs(path):
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, _TMPFS_OPTS) != 0:
        raise IsolationError(_fail(f"cannot hide {path} from the program (mount tmpfs)"))


def _private_mounts(workdir):
    """The program's own view: an empty work dir and /tmp, and its own /proc if allowed."""
    if _libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise IsolationError(_fail("cannot make the program's mounts private"))
    _mount_tmpfs(workdir)
    tmp = os.path.realpath("/tmp")
    if tmp.startswith(workdir.rstrip("/") + "/"):
        os.makedirs(tmp, exist_ok=True)  # host mode: /tmp points into the work dir
    else:
        _mount_tmpfs(tmp)
    # A /proc of its own PID namespace (only its own processes); where the kernel refuses (the
    # sandbox's /proc has covered parts) the inherited one stays: the runner shows there, but
    # being non-dumpable and outside this PID namespace, nothing of it can be opened or signalled.
    _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.chdir(workdir)


def _keep_only(fds):
    top = 0
    for fd in sorted(fds):
        os.closerange(top, fd)
        top = fd + 1
    os.closerange(top, 1 << 16)


def _enter(workdir, keep):
    """In the forked child: become the isolated program process. Returns only in it."""
    uid, gid = os.geteuid(), os.getegid()
    dropped = _drop_uid()
    if dropped:
        uid = gid = NOBODY
    namespaces = _libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC) == 0
    if namespaces:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{NOBODY} {uid} 1")
        _write("/proc/self/gid_map", f"{NOBODY} {gid} 1")
        program = os.fork()  # the next child is PID 1 of the new PID namespace
        if program != 0:
            _keep_only(())
            try:
                os.waitpid(program, 0)
            finally:
                os._exit(0)  # the namespace's init is gone: the kernel ends the rest
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _private_mounts(workdir)
    elif not dropped:
        raise IsolationError(
            _fail("cannot keep the program from the runner: no other uid, and no user + PID namespace")
        )
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    drop_capabilities()
    _keep_only(keep)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)


def start(source, keep_fd, close_fds=(), prelude=None):
    """Fork the isolated program process serving ``source`` (after the dataset's ``prelude``);
    returns (pid, runner's socket).
    ``keep_fd`` is the stderr the program may write to; ``close_fds`` are closed at once."""
    ours, theirs = socket.socketpair()
    status_r, status_w = os.pipe()
    workdir = os.getcwd()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            os.close(status_r)
            for fd in close_fds:
                os.close(fd)
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _enter(workdir, keep=(theirs.fileno(), keep_fd, status_w))
            os.write(status_w, b"ok")
            os.close(status_w)
            try:
                from modal_rl.sandboxes import _program
            except ImportError:
                import _program
            _program.serve(theirs, source, prelude)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.write(status_w, f"error: {exc}"[:1000].encode())
        finally:
            os._exit(0)
    theirs.close()
    os.close(status_w)
    status = b""
    while chunk := os.read(status_r, 1024):
        status += chunk[: 2048 - len(status)]
    os.close(status_r)
    if status != b"ok":
        stop(pid)
        ours.close()
        raise IsolationError(status.decode("utf-8", "replace").removeprefix("error: ") or "it died")
    return pid, ours


def stop(pid):
    """End the program (its namespace with it) and reap it. Safe to call twice."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
