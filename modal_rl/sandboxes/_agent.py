"""In-sandbox agent for ``LocalProvider``: stdlib only, run as ``python3 -I -S -c <this file>``.

Protocol: one JSON object per line on stdin (requests) and stdout (responses), matched by
``id``. Ops: ``ping``, ``exec``, ``write``, ``read``. Byte payloads are base64. An exec's
output is bounded here, where it is read: the first ``stdout_limit`` bytes of stdout (default
``output_cap``; ``stdout_truncated`` says there was more), the last ``stderr_tail`` bytes of
stderr (default: its first ``output_cap`` bytes), so no answer outgrows what the host asked for.

Invariants:
- every command runs in a user and PID namespace of its own, below the agent (``_isolate``):
  a waiter process outside it, an init inside it (PID 1) and the command as its child, with
  RLIMIT_AS / RLIMIT_CPU / RLIMIT_NPROC on the command. When the command exits, the init exits
  and the kernel kills everything else in the namespace (setsid'd or double-forked processes
  included) before the waiter reports; at the wall-clock timeout the agent SIGKILLs the exec's
  process group (waiter and init), with the same effect. So no process of one exec is alive
  when the next exec starts;
- the command cannot reach the agent: the agent is not in its PID namespace (no pid to signal,
  ``kill(-1)`` stops at the namespace), and the agent and every process of ours above the
  command are non-dumpable (``PR_SET_DUMPABLE 0``; forks, never exec'd), so the command cannot
  open their ``/proc/<pid>/mem`` or ``/proc/<pid>/fd/*`` (the agent's request and answer pipes);
- while commands run, a watchdog counts the processes of this PID namespace and, above
  ``max_procs``, kills every process but this agent (``kill(-1)`` only reaches this namespace);
  RLIMIT_NPROC alone does not bind when the host runs as root;
- at the sandbox's lifetime deadline or on EOF from the host the agent exits, and with it the
  namespace (the kernel kills every process in a PID namespace whose init is gone).
"""

import base64
import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

CFG = json.loads(sys.argv[1])
OUT_CAP = int(CFG.get("output_cap", 8 << 20))
_send_lock = threading.Lock()
_active = 0
_active_lock = threading.Lock()
_limit_hit = threading.Event()
_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
_MAXFD = 1 << 16


def send(obj):
    data = (json.dumps(obj) + "\n").encode()
    with _send_lock:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def kill_all_but_me():
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


def nprocs():
    # Stdlib on purpose, not psutil (which the host side uses): this file runs as
    # `python3 -I -S` — no site-packages — with the host's base interpreter, or with an image's
    # own python3 that may have no psutil at all. The /proc here is the sandbox's own PID
    # namespace, so counting its numeric entries is counting the sandbox's processes.
    pids = [name for name in os.listdir("/proc") if name.isdigit()]
    if len(pids) <= CFG["max_procs"]:
        return len(pids)
    live = 0  # above the limit: look closer, killed-but-unreaped zombies do not count
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                live += f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            pass
    return live


def watchdog():
    # Poll only while commands run: idle warm sandboxes must cost nothing.
    while True:
        with _active_lock:
            busy = _active > 0
        if busy and nprocs() > CFG["max_procs"]:
            _limit_hit.set()
            kill_all_but_me()
        time.sleep(0.01 if busy else 0.05)


def lifetime():
    time.sleep(max(0.0, CFG["lifetime_s"]))
    kill_all_but_me()
    os._exit(3)


def _limits(cpu):
    mem = CFG["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (CFG["max_procs"], CFG["max_procs"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _keep_only(fd):
    os.closerange(0, fd)
    os.closerange(fd + 1, _MAXFD)


def _init(cmd, w):
    """PID 1 of an exec's namespace: reap orphans until the command ends, report its status."""
    _keep_only(w)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == cmd:
            os.write(w, status.to_bytes(4, "little"))
            return


def _map_ids(uid, gid):
    """Map the exec's user namespace to the sandbox's uid and gid (the same numbers): a command's
    files get an owner (an unmapped uid cannot create any) and the test runner can give the
    program a user namespace of its own. The command still holds no capability in the
    sandbox's namespaces, so nothing of the agent's is within its reach. Where the map cannot be
    written (the sandbox's uid is 0: that needs CAP_SETFCAP) the exec stays unmapped."""
    try:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        pass


def _isolate(cpu):
    """``preexec_fn`` of every exec (runs in the forked child, one thread): this process stays
    outside as the waiter, its child is the init of a new user + PID namespace, and the init's
    child returns from here to be exec'd as the command. Never returns in the waiter or init."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        os.write(2, f"[sandbox] cannot isolate the exec: unshare: {os.strerror(err)}\n".encode())
        os._exit(125)
    _map_ids(uid, gid)
    r, w = os.pipe()
    init = os.fork()
    if init == 0:
        cmd = -1
        try:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            cmd = os.fork()
            if cmd != 0:
                _init(cmd, w)
        finally:
            if cmd != 0:
                os._exit(0)  # init exits: the kernel kills whatever is left in the namespace
        os.close(r)
        os.close(w)
        _limits(cpu)
        return  # the command: subprocess execs argv here
    try:
        _keep_only(r)
        got = os.read(r, 4)
        os.waitpid(init, 0)  # returns once every process of the namespace is gone
        status = int.from_bytes(got, "little") if len(got) == 4 else signal.SIGKILL
        if os.WIFSIGNALED(status):  # report the command's signal as our own, as a plain exec would
            sig = os.WTERMSIG(status)
            _libc.signal(sig, 0)  # SIG_DFL
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
    finally:
        os._exit(1)


def _drain_head(stream, buf, cap, over):
    """Keep the first ``cap`` bytes; read (and drop) the rest, so the command never blocks on a
    full pipe; ``over`` is set when there was more."""
    while True:
        chunk = stream.read(65536)
        if not chunk:
            return
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > room:
            over.set()


def _drain_tail(stream, buf, keep, over):
    """Keep the last ``keep`` bytes: memory stays within 2x ``keep`` + one read."""
    while True:
        chunk = stream.read(65536)
        if not chunk:
            del buf[: max(0, len(buf) - keep)]
            return
        buf += chunk
        if len(buf) > 2 * keep:
            del buf[: len(buf) - keep]


def _feed(pipe, data):
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass  # the command exited without reading its input


def do_exec(req):
    global _active
    t0 = time.monotonic()
    env = dict(CFG["env"])
    env.update(req.get("env") or {})
    stdin = base64.b64decode(req["stdin"]) if req.get("stdin") is not None else None
    with _active_lock:
        _active += 1
    try:
        try:
            p = subprocess.Popen(
                req["argv"],
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=req.get("cwd") or CFG["workdir"],
                env=env,
                start_new_session=True,
                preexec_fn=lambda: (
                    _isolate(int(req["cpu_s"]))
                    if CFG.get("exec_namespaces", True)
                    else _limits(int(req["cpu_s"]))
                ),
            )
        except OSError as exc:
            msg = f"{req['argv'][0]}: {exc.strerror or exc}\n"
            return {
                "rc": 127,
                "stdout": "",
                "stderr": base64.b64encode(msg.encode()).decode(),
                "timed_out": False,
            }
        outs, over = (bytearray(), bytearray()), threading.Event()
        out_cap = OUT_CAP if req.get("stdout_limit") is None else int(req["stdout_limit"])
        err_tail = req.get("stderr_tail")
        readers = [
            threading.Thread(target=_drain_head, args=(p.stdout, outs[0], out_cap, over), daemon=True),
            threading.Thread(
                target=_drain_head if err_tail is None else _drain_tail,
                args=(p.stderr, outs[1], OUT_CAP if err_tail is None else int(err_tail), threading.Event()),
                daemon=True,
            ),
        ]
        for r in readers:
            r.start()
        if stdin is not None:
            # A writer thread: a command that never reads must not block the timeout below.
            threading.Thread(target=_feed, args=(p.stdin, stdin), daemon=True).start()
        timed_out = False
        try:
            rc = p.wait(timeout=req["timeout_s"])
        except subprocess.TimeoutExpired:
            timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the group: background children die with the exec
        if timed_out:
            rc = p.wait()
        _wait_group_gone(p.pid)
        for r in readers:
            r.join(timeout=0.5)  # a setsid'ed grandchild may hold the pipe; do not wait for it
        err = bytes(outs[1])
        if _limit_hit.is_set():
            err += b"\n[sandbox] process limit exceeded: all processes killed\n"
        return {
            "rc": rc,
            "stdout": base64.b64encode(bytes(outs[0])).decode(),
            "stdout_truncated": over.is_set(),
            "stderr": base64.b64encode(err).decode(),
            "timed_out": timed_out,
            "duration_s": time.monotonic() - t0,
        }
    finally:
        with _active_lock:
            _active -= 1
            if _active == 0:
                _limit_hit.clear()


def _wait_group_gone(pgid, bound_s=2.0):
    """SIGKILL is delivered asynchronously: wait (bounded) until every member of the exec's
    process group has died and been reaped, so an exec returns only once its background
    children are gone, not merely signalled."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.005)


def resolve(path):
    return path if path.startswith("/") else os.path.join(CFG["workdir"], path)


def handle(req):
    op = req.get("op")
    try:
        if op == "ping" and _ISOLATION_ERROR:
            res = {"error": "IsolationError", "message": _ISOLATION_ERROR}
        elif op == "ping":
            res = {"ok": True, "pid": os.getpid()}
        elif op == "exec":
            res = do_exec(req)
        elif op == "write":
            path = resolve(req["path"])
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(req["data"]))
            res = {"ok": True}
        elif op == "read":
            with open(resolve(req["path"]), "rb") as f:
                res = {"data": base64.b64encode(f.read()).decode()}
        else:
            res = {"error": "ValueError", "message": f"unknown op {op!r}"}
    except OSError as exc:
        res = {"error": type(exc).__name__, "message": str(exc), "errno": exc.errno}
    except Exception as exc:  # report, never die: one bad request must not kill the sandbox
        res = {"error": type(exc).__name__, "message": str(exc)}
    res["id"] = req.get("id")
    send(res)


def _probe_isolation():
    """Refuse to serve (at ``ping``, so the sandbox never counts as ready) where an exec could
    not get its own namespaces: never run a command without them."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _libc.unshare(CLONE_NEWUSER | CLONE_NEWPID) == 0 else 1)
    if os.waitpid(pid, 0)[1] != 0:
        return "cannot give an exec its own user and PID namespace (unprivileged user namespaces disabled?)"
    return None


_ISOLATION_ERROR = None


def main():
    global _ISOLATION_ERROR
    _libc.prctl(PR_SET_DUMPABLE, 0)  # no /proc/<agent>/mem or fd/* for sandboxed code
    _ISOLATION_ERROR = _probe_isolation()
    os.makedirs(os.path.join(CFG["workdir"], ".tmp"), exist_ok=True)
    threading.Thread(target=watchdog, daemon=True).start()
    threading.Thread(target=lifetime, daemon=True).start()
    for line in sys.stdin.buffer:
        threading.Thread(target=handle, args=(json.loads(line),), daemon=True).start()
    kill_all_but_me()  # host went away: take the namespace down with us
    os._exit(0)


main()
