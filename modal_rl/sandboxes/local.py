"""``LocalProvider``: sandboxes as bubblewrap'd process trees on this host.

Design: one long-lived ``bwrap`` per sandbox running a small stdlib agent (``_agent.py``) that
speaks JSON lines over the bwrap process's stdin/stdout. ``exec`` is one round trip to the agent,
which forks the command inside the sandbox; so a warm sandbox costs one idle Python process, a
claim costs nothing, and an exec costs a fork (no per-exec bwrap start).

Isolation: own PID/IPC/UTS/network namespaces (``network=True`` wires the network one to the
host through slirp4netns, never to the host's loopback: ``localnet``); the root is
read-only (host mode: /usr, a few /etc files and the running Python; image mode: a root-fs
directory); the only writable place is a size-limited tmpfs work dir (``/tmp`` points into it
in host mode). Limits: RLIMIT_AS (memory_mb per process), RLIMIT_CPU (cpu × exec timeout),
a process-count watchdog, a wall-clock kill of each command's process group, and the
sandbox lifetime (agent exit + host backstop). bwrap runs with ``--die-with-parent`` in its
own session, so killing its process group - or the pool's process dying - ends it all.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from modal_rl.sandboxes import live_records, localnet
from modal_rl.sandboxes.envguard import check_env
from modal_rl.sandboxes.errors import ProviderUnavailableError, SandboxLostError, TransientProviderError
from modal_rl.sandboxes.hostroot import host_root_args
from modal_rl.sandboxes.provider import Provider, SandboxHandle, check_argv, check_output_bounds
from modal_rl.sandboxes.spec import ExecResult, SandboxSpec
from modal_rl.sandboxes.testrun import testkit_binds

_AGENT_SRC = (Path(__file__).with_name("_agent.py")).read_text()
# Grace on top of a command's own timeout before the host declares the agent hung.
_EXEC_GRACE_S = 10.0
SANDBOX_UID = 1000  # the uid (and gid) sandboxed processes have in the sandbox


class LocalProvider(Provider):
    """Bubblewrap sandboxes. Raises ``ProviderUnavailableError`` at construction if bwrap is
    missing, and at a ``network=True`` create if slirp4netns is."""

    name = "local"
    # Each exec in its own user + PID namespace (``_agent._isolate``). False only to measure what
    # that costs (benchmarks/sandboxes_scoring.py): never for code a policy wrote.
    exec_namespaces = True

    def __init__(
        self,
        *,
        bwrap: str = "bwrap",
        slirp4netns: str = "slirp4netns",
        registry_dir: Path | str | None = None,
        create_rate: float = 50.0,
        create_burst: int = 50,
        output_cap_bytes: int = 8 << 20,
    ):
        found = shutil.which(bwrap)
        if found is None:
            raise ProviderUnavailableError(
                f"bubblewrap ({bwrap!r}) not found on PATH: LocalProvider needs it "
                "(Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
            )
        self.bwrap = found
        # bwrap's --die-with-parent guards the sandbox, not bwrap itself: a bwrap still setting
        # up when the pool's process dies would linger. setpriv makes the kernel kill it too.
        self.setpriv = shutil.which("setpriv")
        self.slirp4netns = slirp4netns  # looked up at the first network=True create
        self.registry_dir = Path(registry_dir) if registry_dir is not None else live_records.default_dir()
        self.create_rate = create_rate
        self.create_burst = create_burst
        self.output_cap_bytes = output_cap_bytes
        self._starting: set[int] = set()  # process groups of creates that have not returned

    def command(
        self, spec: SandboxSpec, sandbox_id: str, net: localnet.SandboxNetwork | None = None
    ) -> list[str]:
        """The full bwrap argv for one sandbox (pure; tested directly). ``net`` (network=True)
        adds the fds that let the host wire the sandbox's network namespace up."""
        wd = spec.workdir
        # A user namespace locks the read-only mounts; --cap-drop ALL because bwrap keeps root's caps.
        args = [self.setpriv, "--pdeathsig", "KILL", "--"] if self.setpriv else []
        args += [self.bwrap, "--die-with-parent", "--unshare-user", "--cap-drop", "ALL", "--unshare-pid"]
        # Not uid 0 inside: an exec's user namespace can then map the sandbox's uid without
        # CAP_SETFCAP (``_agent._map_ids``), so commands create files and nest namespaces.
        args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        args += ["--unshare-ipc", "--unshare-uts"]
        args += ["--unshare-cgroup-try", "--hostname", "sandbox"]
        args.append("--unshare-net")  # always: network=True adds slirp4netns, never the host's stack
        size = str(spec.disk_mb << 20)
        if spec.image in (None, "host"):
            root, path = host_root_args()
            root += testkit_binds()  # pytest for the test runner (never on the program's path)
            python = os.path.realpath(sys.executable)
            tmp = ["--dir", f"{wd}/.tmp", "--symlink", f"{wd}/.tmp", "/tmp"]
        else:
            image = Path(spec.image)
            if not image.is_dir():
                raise ValueError(
                    f"LocalProvider: image must be None, 'host' or a root-fs directory, got {spec.image!r}"
                )
            root, path, python = (
                ["--ro-bind", str(image), "/"],
                ["/usr/local/bin", "/usr/bin", "/bin"],
                "python3",
            )
            tmp = ["--size", size, "--tmpfs", "/tmp"]
        args += root + ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", wd] + tmp
        if spec.network and net is not None:
            args += net.bwrap_args()  # after root: its resolv.conf goes over the host's
        # bwrap builds the root on a writable tmpfs; freeze it so only the work dir takes writes.
        args += ["--remount-ro", "/"]
        env = {
            "PATH": ":".join(path),
            "HOME": wd,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.update(check_env(spec.env, "SandboxSpec.env"))
        args += ["--chdir", wd, "--clearenv"]
        for k, v in env.items():
            args += ["--setenv", k, v]
        cfg = {
            "workdir": wd,
            "env": env,
            "memory_mb": spec.memory_mb,
            "max_procs": spec.max_procs,
            "lifetime_s": spec.timeout_s,
            "output_cap": self.output_cap_bytes,
            "exec_namespaces": self.exec_namespaces,
        }
        return args + ["--", python, "-I", "-S", "-c", _AGENT_SRC, json.dumps(cfg)]

    async def create(self, spec: SandboxSpec, *, tags: Mapping[str, str]) -> LocalSandbox:
        sandbox_id = f"lsb-{uuid.uuid4().hex[:12]}"
        live_records.open_dir(self.registry_dir)  # one that is not ours is refused before anything starts
        net = localnet.for_spec(spec, self.slirp4netns, self.setpriv)  # None unless network=True
        proc = None
        try:
            proc = await self._spawn(self.command(spec, sandbox_id, net), net)
            self._starting.add(proc.pid)
            try:
                live_records.register(self.registry_dir, sandbox_id, proc.pid, tags)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)  # unregistered means unsweepable: never keep it
                await proc.wait()
                raise
        except BaseException:
            if proc is not None:
                self._starting.discard(proc.pid)
            if net is not None:
                net.close()
            raise
        sandbox = LocalSandbox(self, sandbox_id, proc, spec, dict(tags))
        try:
            if net is not None:
                await sandbox._start_network(net)
        finally:
            self._starting.discard(proc.pid)
        return sandbox

    def kill_starting_now(self) -> None:
        # A create still in flight when the pool's process is told to stop: its bwrap is not the
        # pool's yet (asyncio may not even have returned its pid), and bwrap's setup fork has no
        # parent-death signal, so only its group's SIGKILL ends it (seen: a bwrap waiting forever
        # on its eventfd, parent PID 1). Our own children that lead a bwrap session are sandboxes.
        groups = set(self._starting)
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.Error, OSError):
                    if child.name() in ("bwrap", "setpriv") and os.getpgid(child.pid) == child.pid:
                        groups.add(child.pid)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    async def _spawn(
        self, argv: list[str], net: localnet.SandboxNetwork | None
    ) -> asyncio.subprocess.Process:
        spawn = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group: killpg reaches bwrap and the agent
                # bwrap's PID-1 inside the sandbox is a fork of bwrap, so its /proc/1/environ is
                # bwrap's own environment, readable by sandboxed code: start bwrap with none of
                # ours (run key, Modal credentials); --clearenv only covers what it execs.
                env={"PATH": os.environ.get("PATH", os.defpath)},
                limit=4 * self.output_cap_bytes + (1 << 20),
                pass_fds=net.bwrap_fds if net is not None else (),
            )
        )
        try:
            return await asyncio.shield(spawn)
        except asyncio.CancelledError:
            # Cancelling process creation midway hangs Python 3.11 (the child's exit is never
            # watched); let the spawn finish, then kill what it started.
            proc = await spawn
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            proc._transport.close()
            raise
        finally:
            if net is not None:
                net.spawned()

    async def sweep(self, tags: Mapping[str, str]) -> int:
        return live_records.sweep(self.registry_dir, tags)


class LocalSandbox(SandboxHandle):
    """Host side of one bubblewrap sandbox: request/response multiplexing to the agent."""

    def __init__(
        self,
        provider: LocalProvider,
        sandbox_id: str,
        proc: asyncio.subprocess.Process,
        spec: SandboxSpec,
        tags: dict,
    ):
        self.id = sandbox_id
        self.tags = tags
        self.pid = proc.pid
        self.spec = spec
        self.expires_at = time.monotonic() + spec.timeout_s
        self._provider = provider
        self._proc = proc
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._stderr_tail = b""
        self._dead_reason: str | None = None
        self._net: localnet.SandboxNetwork | None = None
        self._reader = asyncio.ensure_future(self._read_loop())
        self._errreader = asyncio.ensure_future(self._read_stderr())
        # Backstop for the agent's own lifetime limit.
        self._expiry = asyncio.get_running_loop().call_later(spec.timeout_s + 1.0, self.kill_now)

    def is_alive(self) -> bool:
        return self._dead_reason is None and self._proc.returncode is None

    async def _read_stderr(self) -> None:
        while chunk := await self._proc.stderr.read(4096):
            self._stderr_tail = (self._stderr_tail + chunk)[-4096:]

    async def _read_loop(self) -> None:
        try:
            while line := await self._proc.stdout.readline():
                msg = json.loads(line)
                fut = self._pending.pop(msg.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (ValueError, asyncio.LimitOverrunError) as exc:
            self._dead_reason = f"protocol error from agent: {exc}"
        except asyncio.CancelledError:
            # Our event loop is going away (e.g. asyncio.run ended with the pool never closed):
            # nobody can talk to this sandbox any more, so it ends now instead of outliving the
            # loop, and the wait below cannot hang the loop's shutdown.
            self._dead_reason = self._dead_reason or f"sandbox {self.id}: its event loop was shut down"
            self.kill_now()
            raise
        finally:
            rc = await self._proc.wait()
            await asyncio.sleep(0)  # let the stderr reader catch the last words
            if self._dead_reason is None:
                tail = self._stderr_tail.decode(errors="replace").strip()
                self._dead_reason = f"sandbox {self.id} exited (rc={rc})" + (f": {tail}" if tail else "")
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(SandboxLostError(self._dead_reason))
            self._pending.clear()
            self._expiry.cancel()
            live_records.unregister(self._provider.registry_dir, self.id)

    async def _call(self, op: str, deadline_s: float, **fields) -> dict:
        if not self.is_alive():
            raise SandboxLostError(self._dead_reason or f"sandbox {self.id} is not running")
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            self._proc.stdin.write((json.dumps({"id": rid, "op": op, **fields}) + "\n").encode())
            await self._proc.stdin.drain()
        except (ConnectionError, RuntimeError) as exc:
            self._pending.pop(rid, None)
            raise SandboxLostError(f"sandbox {self.id}: cannot reach agent: {exc}") from exc
        try:
            msg = await asyncio.wait_for(fut, deadline_s)
        except TimeoutError:
            self._pending.pop(rid, None)
            self.kill_now()  # an agent that misses its own deadline is broken; do not reuse it
            raise SandboxLostError(
                f"sandbox {self.id}: agent did not answer {op!r} within {deadline_s:.1f}s"
            ) from None
        if "error" in msg:
            if msg.get("errno") is not None:
                raise OSError(msg["errno"], f"sandbox {self.id}: {msg['message']}")
            raise SandboxLostError(f"sandbox {self.id}: agent error {msg['error']}: {msg['message']}")
        return msg

    async def _start_network(self, net: localnet.SandboxNetwork) -> None:
        """Bring the network up before anyone can exec; on any failure the sandbox ends."""
        self._net = net
        try:
            await net.start()
        except BaseException as exc:
            await self.terminate()
            if not isinstance(exc, TransientProviderError):
                raise
            tail = " ".join(self._stderr_tail.decode(errors="replace").split())[-400:]
            raise TransientProviderError(
                f"sandbox {self.id}: {exc}" + (f" (bwrap: {tail})" if tail else "")
            ) from None

    async def ready(self) -> None:
        await self._call("ping", 3600.0)  # the pool bounds this with its ready timeout

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdout_limit_bytes: int | None = None,
        stderr_tail_bytes: int | None = None,
    ) -> ExecResult:
        check_argv(argv)
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"exec timeout_s must be a positive number, got {timeout_s!r}")
        check_output_bounds(stdout_limit_bytes, stderr_tail_bytes)
        bounds = {"stdout_limit": stdout_limit_bytes, "stderr_tail": stderr_tail_bytes}
        data = stdin.encode() if isinstance(stdin, str) else stdin
        msg = await self._call(
            "exec",
            timeout_s + _EXEC_GRACE_S,
            argv=list(argv),
            timeout_s=timeout_s,
            cpu_s=math.ceil(timeout_s * self.spec.cpu) + 1,
            stdin=base64.b64encode(data).decode() if data is not None else None,
            env=check_env(env, "exec env"),
            cwd=cwd,
            **{k: v for k, v in bounds.items() if v is not None},  # absent: the agent's cap
        )
        return ExecResult(
            returncode=int(msg["rc"]),
            stdout=base64.b64decode(msg["stdout"]).decode(errors="replace"),
            stderr=base64.b64decode(msg["stderr"]).decode(errors="replace"),
            timed_out=bool(msg["timed_out"]),
            duration_s=float(msg.get("duration_s", 0.0)),
            stdout_truncated=bool(msg.get("stdout_truncated", False)),
        )

    async def write_file(self, path: str, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self._call("write", 60.0, path=str(path), data=base64.b64encode(raw).decode())

    async def read_file(self, path: str) -> bytes:
        msg = await self._call("read", 60.0, path=str(path))
        return base64.b64decode(msg["data"])

    def kill_now(self) -> None:
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self._net is not None:
            self._net.kill()  # not in bwrap's group; it would exit on its own, this is at once
        self._dead_reason = self._dead_reason or f"sandbox {self.id} was terminated"
        live_records.unregister(self._provider.registry_dir, self.id)

    async def terminate(self) -> None:
        self.kill_now()
        with contextlib.suppress(ProcessLookupError):
            await self._proc.wait()
        await asyncio.gather(self._reader, self._errreader, return_exceptions=True)
        if self._net is not None:
            await self._net.wait()
        # Close the pipes now, inside the loop; the transport's __del__ would do it after close.
        transport = getattr(self._proc, "_transport", None)
        if transport is not None:
            transport.close()
