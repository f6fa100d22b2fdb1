"""``network=True`` for local sandboxes: a network namespace of their own, wired to the host
by slirp4netns, with no way to the host's loopback.

Why slirp4netns rather than pasta (passt): slirp4netns has the exact switch this needs,
``--disable-host-loopback``, and ``--ready-fd`` / ``--exit-fd`` to tie its life to the
sandbox's, with a CLI stable since 0.4 in every distribution that ships bubblewrap. pasta's
defaults go the other way: ``-T auto -U auto`` forward every port bound on the host into the
namespace's loopback and the gateway address maps to the host, so each would have to be
turned off by flags whose defaults moved between releases, and it daemonizes unless told not
to. slirp's cost, a slower user-space TCP/IP stack, does not matter for a sandbox's downloads.

Invariants:
- a sandbox never shares the host's network namespace (bwrap ``--unshare-net`` always);
  network=False stops there: only ``lo``;
- network=True: slirp4netns ``--configure`` adds ``tap0`` (10.0.2.100/24, default route via
  10.0.2.2) with ``--disable-host-loopback``: slirp refuses packets to the gateway instead of
  handing them to the host's 127.0.0.1, and 127.0.0.1 inside is the sandbox's own ``lo``;
- slirp opens the sandbox's connections from the host, where the host's own addresses would
  reach its wildcard (0.0.0.0) listeners: so every IPv4 address of the host's interfaces (as
  of the sandbox's start), and link-local 169.254.0.0/16 (a cloud VM's metadata service), is
  an ``unreachable`` route inside the sandbox, set by a helper that joins its namespaces. The
  sandboxed code has no capability (bwrap ``--cap-drop ALL``), so it cannot change routes.
  IPv6 is off (slirp without ``-6``);
- DNS: in host mode ``/etc/resolv.conf`` names slirp's forwarder (10.0.2.3), which asks the
  host's resolvers, so a resolver on the host's loopback (systemd-resolved) still answers
  DNS, and only DNS; an image brings its own ``resolv.conf``;
- the network is up (routes, tap0, default route) before ``LocalProvider.create`` returns;
- slirp4netns lives as long as the sandbox: its ``--exit-fd`` is a pipe whose only write
  ends are held by bwrap (``--sync-fd``: its monitor and the sandbox's PID 1), so however the
  sandbox ends (terminate, lifetime, a sweep's killpg, the pool's process dying) slirp reads
  EOF and exits; terminate also kills and reaps it at once, and it dies with the pool's
  process (``setpriv --pdeathsig``, as bwrap does);
- slirp4netns parses packets the sandboxed code writes, so it runs ``--enable-seccomp`` (a
  syscall filter) and, as root, ``--enable-sandbox`` (a mount namespace of its own, no
  capabilities; a non-root slirp has none, and could not make the namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import psutil

from modal_rl.sandboxes.errors import ProviderUnavailableError, TransientProviderError

GATEWAY, DNS = "10.0.2.2", "10.0.2.3"  # slirp4netns's defaults (--cidr 10.0.2.0/24)
# Link-local: a cloud VM's metadata service (169.254.169.254) hands out the host's credentials.
LINK_LOCAL = "169.254.0.0/16"
SETUP_TIMEOUT_S = 30.0
_NS_GET_USERNS = 0xB701  # ioctl on a namespace fd: an fd of the user namespace that owns it
_TAIL = 4096

# Run as ``python -I -S -c _ROUTES_SRC <userns fd> <netns fd> <addr/len>...``: joins the
# sandbox's network namespace and the user namespace that owns it (a fresh interpreter is
# single-threaded, as setns(CLONE_NEWUSER) requires) and adds an unreachable route per network
# over rtnetlink: no iproute2 needed, and an exec'd `ip` would lose the capabilities setns gave
# when the caller is not root.
_ROUTES_SRC = r"""
import ctypes, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
for fd, flag in ((sys.argv[1], 0x10000000), (sys.argv[2], 0x40000000)):  # CLONE_NEWUSER, _NEWNET
    if libc.setns(int(fd), flag) != 0:
        sys.exit(f"setns: {os.strerror(ctypes.get_errno())}")
nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
for seq, net in enumerate(sys.argv[3:], 1):
    addr, bits = net.split("/")
    # rtmsg: AF_INET, dst /bits, table main (254), proto static (4), scope universe, RTN_UNREACHABLE (7)
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, int(bits), 0, 0, 254, 4, 0, 7, 0)
    body += struct.pack("=HH4s", 8, 1, socket.inet_aton(addr))  # RTA_DST
    # RTM_NEWROUTE (24); NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE
    nl.send(struct.pack("=IHHII", 16 + len(body), 24, 0x1 | 0x4 | 0x200 | 0x400, seq, 0) + body)
    err = struct.unpack_from("=i", nl.recv(4096), 16)[0]
    if err:
        sys.exit(f"route to {net}: {os.strerror(-err)}")
"""


def find_slirp(name: str) -> str:
    """The path of slirp4netns; ``ProviderUnavailableError`` (one line) if it is missing."""
    found = shutil.which(name)
    if found is None:
        raise ProviderUnavailableError(
            f"slirp4netns ({name!r}) not found on PATH: LocalProvider needs it for network=True "
            "(Debian/Ubuntu: apt-get install slirp4netns; Fedora: dnf install slirp4netns)"
        )
    return found


def for_spec(spec, slirp4netns: str, setpriv: str | None) -> SandboxNetwork | None:
    """The network of a sandbox of ``spec`` (a ``SandboxSpec``): None unless ``spec.network``."""
    if not spec.network:
        return None
    return SandboxNetwork(find_slirp(slirp4netns), resolv=spec.image in (None, "host"), setpriv=setpriv)


def blocked() -> list[str]:
    """The networks a sandbox must not reach: each host address (/32) and link-local."""
    return [f"{a}/32" for a in host_ipv4()] + [LINK_LOCAL]


def host_ipv4() -> list[str]:
    """The IPv4 addresses of this host's interfaces, loopback and slirp's own left out."""
    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                out.add(a.address)
    return sorted(out - {GATEWAY, DNS})  # a route over those would cut the sandbox off


def resolv_conf() -> bytes:
    """The sandbox's resolv.conf: slirp's DNS forwarder, plus the host's search/options lines."""
    try:
        host = Path("/etc/resolv.conf").read_text().splitlines()
    except OSError:
        host = []
    keep = [ln for ln in host if ln.split()[:1] in (["search"], ["domain"], ["options"])]
    return "\n".join([f"nameserver {DNS}", *keep, ""]).encode()


async def _read_pipe(fd: int, n: int = -1) -> bytes:
    """Up to ``n`` bytes (-1: all until EOF) from pipe ``fd``, which this takes and closes."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except BaseException:
        pipe.close()
        raise
    try:
        return await reader.read(n)
    finally:
        transport.close()


async def _spawn(argv: list[str], **kw) -> asyncio.subprocess.Process:
    """``create_subprocess_exec`` that a cancel cannot cut midway (Python 3.11 would never watch
    the child's exit: a hang); on cancel the child is killed and reaped, then the cancel goes on."""
    task = asyncio.ensure_future(asyncio.create_subprocess_exec(*argv, **kw))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await _reap(await task)
        raise


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill (if still running) and reap ``proc``, and close its pipes now, inside the loop: the
    transport's ``__del__`` would try after the loop closed."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()


class SandboxNetwork:
    """Host side of one sandbox's network (module invariants).

    Order of use: ``bwrap_args()`` / ``bwrap_fds`` into bwrap's start, ``spawned()`` once bwrap
    started (or failed to), ``await start()``, then ``kill()`` and ``await wait()`` when the
    sandbox ends; ``close()`` if bwrap never started. Owns every fd it made until then.
    """

    def __init__(self, slirp: str, *, resolv: bool, setpriv: str | None = None):
        self.slirp = slirp
        # The kernel kills slirp when the pool's process dies, too: a bwrap that died mid-setup
        # can leave its PID 1 (holding the exit pipe) behind; slirp must not stay with it.
        self.prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        self.proc: asyncio.subprocess.Process | None = None
        self._fds: set[int] = set()
        self._info_r, self._info_w = self._pipe()
        self._exit_r, self._exit_w = self._pipe()
        self._resolv_r = None
        if resolv:
            self._resolv_r, w = self._pipe()
            os.write(w, resolv_conf())  # a few lines: fits the pipe buffer, never blocks
            self._close(w)
        self._killed = False
        self._drain: asyncio.Future | None = None
        self._tail = b""

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe()  # not inheritable: only a child given them in pass_fds gets them
        self._fds |= {r, w}
        return r, w

    def _close(self, fd: int | None) -> None:
        if fd in self._fds:
            self._fds.discard(fd)
            os.close(fd)

    @property
    def bwrap_fds(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self._info_w, self._exit_w, self._resolv_r) if fd is not None)

    def bwrap_args(self) -> list[str]:
        args = ["--info-fd", str(self._info_w), "--sync-fd", str(self._exit_w)]
        if self._resolv_r is not None:
            args += ["--ro-bind-data", str(self._resolv_r), "/etc/resolv.conf"]
        return args

    def spawned(self) -> None:
        """bwrap holds its ends now (or failed to start): ours must go, or EOF never comes."""
        for fd in self.bwrap_fds:
            self._close(fd)

    async def start(self) -> None:
        """Wait for bwrap's sandbox, block the host's addresses in it, bring up slirp4netns;
        ``TransientProviderError`` if that fails or takes over ``SETUP_TIMEOUT_S``."""
        try:
            await asyncio.wait_for(self._start(), SETUP_TIMEOUT_S)
        except TimeoutError:
            raise TransientProviderError(f"no network within {SETUP_TIMEOUT_S:.0f}s") from None

    async def _start(self) -> None:
        self._fds.discard(self._info_r)  # _read_pipe closes it, however it ends
        info = await _read_pipe(self._info_r)
        try:
            pid = int(json.loads(info)["child-pid"])
            # By fd, not by pid: no pid reuse. The user namespace is the one that owns the network
            # namespace, not the sandbox's own: bwrap run by a non-root user with --dev nests
            # one more user namespace inside the one it made the network namespace in.
            netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            self._fds.add(netns)
            userns = fcntl.ioctl(netns, _NS_GET_USERNS)
            self._fds.add(userns)
        except (ValueError, KeyError, TypeError, OSError):
            raise TransientProviderError("bwrap ended before the sandbox's namespaces existed") from None
        if nets := blocked():
            helper = await _spawn(
                [sys.executable, "-I", "-S", "-c", _ROUTES_SRC, str(userns), str(netns), *nets],
                pass_fds=(userns, netns),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await helper.communicate()
            finally:
                await _reap(helper)
            if helper.returncode:
                raise TransientProviderError(
                    f"could not block the host's addresses in the sandbox: {err.decode(errors='replace').strip()}"
                )
        await self._start_slirp(userns, netns)

    async def _start_slirp(self, userns: int, netns: int) -> None:
        ready_r, ready_w = self._pipe()
        argv = [
            *self.prefix,
            self.slirp,
            "--configure",
            "--mtu=65520",
            "--disable-host-loopback",
            "--enable-seccomp",
            # Root's slirp would parse the sandbox's packets with every capability: this drops
            # them. A non-root one has none to drop, and cannot make the mount namespace.
            *(["--enable-sandbox"] if os.geteuid() == 0 else []),
            f"--ready-fd={ready_w}",
            f"--exit-fd={self._exit_r}",
            f"--userns-path=/proc/self/fd/{userns}",  # slirp's own copies of our two fds
            "--netns-type=path",
            f"/proc/self/fd/{netns}",
            "tap0",
        ]
        try:
            self.proc = await _spawn(
                argv,
                pass_fds=(ready_w, self._exit_r, userns, netns),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C to the terminal's group is the pool's to handle
            )
        finally:
            for fd in (ready_w, self._exit_r, userns, netns):  # ready_w: EOF if slirp dies unready
                self._close(fd)
        self._drain = asyncio.ensure_future(self._read_stderr())
        if self._killed:  # the sandbox ended while slirp was starting
            self.kill()
        self._fds.discard(ready_r)  # _read_pipe closes it, however it ends
        if await _read_pipe(ready_r, 1) != b"1":
            await self.proc.wait()
            await asyncio.wait({self._drain}, timeout=1.0)
            tail = " ".join(self._tail.decode(errors="replace").split())
            raise TransientProviderError(
                f"slirp4netns exited (rc={self.proc.returncode}) before the network was up: {tail[-400:]}"
            )

    async def _read_stderr(self) -> None:
        # slirp writes a few lines at start and exit; keep reading so it never blocks on a full pipe
        while chunk := await self.proc.stderr.read(4096):
            self._tail = (self._tail + chunk)[-_TAIL:]

    def kill(self) -> None:
        """SIGKILL slirp4netns (it would exit on its own once bwrap is gone; this is at once)."""
        self._killed = True
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def wait(self) -> None:
        """Reap slirp4netns and close what is left."""
        if self.proc is not None:
            await self.proc.wait()
            if self._drain is not None:
                await asyncio.gather(self._drain, return_exceptions=True)
            await _reap(self.proc)
        self.close()

    def close(self) -> None:
        for fd in list(self._fds):
            self._close(fd)
