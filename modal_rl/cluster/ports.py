"""Ports for local servers and Ray nodes, from a range nothing else on the host draws from.

Binding port 0 and releasing it (the usual "free port" trick) races: between the release and
the server's own bind, the kernel may hand the same port to anyone's next ``bind(0)`` or
outgoing connection (seen in CI: a Ray dashboard failing with "address already in use").
Here ports come from below the kernel's ephemeral range (``ip_local_port_range``), which the
kernel never hands out by itself, and above Ray's default worker-port range (10002-19999).
Among our own processes, a port is claimed by binding an abstract unix socket named after it:
the claim is host-wide, costs no file, and dies with the process that holds it.

The claim keeps our own processes off a port, not other users: its name is listed in
``/proc/net/unix`` for all to read, and anyone may bind the port itself before our server does.
``reserve_held`` also holds the TCP port: a socket bound to ``(host, port)`` with
``SO_REUSEPORT`` alone, never listening. The kernel then refuses every other user's bind of that
port (any address, any flags: ``SO_REUSEPORT`` groups are per user), while a server of our own
user that binds with ``SO_REUSEPORT`` (vLLM does) joins the group and takes the port over when
the holder is closed. A server that binds without it cannot start while the hold is open, so
only servers known to set it get a held port.

Invariants: a port returned by ``reserve`` was free on ``host`` when picked and stays claimed
by this process for ``hold_s`` (long enough for a bring-up to bind it; at most ``_MAX_CLAIMS``
claims are held, oldest released first); no two live processes using this module get the same
claimed port at once; a port ``reserve_held`` returns was free (no socket of any user on it)
when its hold was bound, and no other user can bind it while that hold is open.
"""

from __future__ import annotations

import random
import socket
import threading
import time

_RAY_WORKER_PORTS_END = 19999
# A claim is a file descriptor: bound how many one process holds (a test session makes hundreds
# of plans), oldest released first; a bring-up binds its ports within seconds anyway.
_MAX_CLAIMS = 256
_CLAIM_PREFIX = b"\0modal-rl-port-"
_lock = threading.Lock()
_claims: list[tuple[float, socket.socket]] = []


def port_range() -> range:
    """The ports we draw from: above Ray's worker ports, below the kernel's ephemeral range."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    start = _RAY_WORKER_PORTS_END + 1
    if low - start < 1024:  # an unusual ephemeral range: take what is below it
        start = max(1024, low - 8192)
    return range(start, low)


def _claim(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_CLAIM_PREFIX + str(port).encode())
        return sock
    except OSError:
        sock.close()
        return None


def _free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False


def _hold(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``(host, port)`` with ``SO_REUSEPORT`` only (module docstring); None
    when the port is not free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        return sock
    except OSError:
        sock.close()
        return None


def reserve(count: int, host: str = "127.0.0.1", *, hold_s: float = 120.0) -> list[int]:
    """``count`` distinct ports, free on ``host`` and claimed by this process for ``hold_s``."""
    return [port for port, _ in _reserve(count, host, hold_s, held=False)]


def reserve_held(
    count: int, host: str = "127.0.0.1", *, hold_s: float = 120.0
) -> list[tuple[int, socket.socket]]:
    """As ``reserve``, each port also held against other users until the caller closes its
    socket (module docstring): ``[(port, hold), ...]``. Close a hold once the server listens."""
    return _reserve(count, host, hold_s, held=True)


def _reserve(count: int, host: str, hold_s: float, held: bool) -> list[tuple[int, socket.socket | None]]:
    ports = port_range()
    now = time.monotonic()
    out: list[tuple[int, socket.socket | None]] = []
    with _lock:
        for _, sock in [c for c in _claims if c[0] < now]:
            sock.close()
        _claims[:] = [c for c in _claims if c[0] >= now]
        offset = random.randrange(len(ports))
        for i in range(len(ports)):
            port = ports[(offset + i) % len(ports)]
            claim = _claim(port)
            if claim is None:
                continue  # another of our processes holds it
            # Free of every socket first (a hold alone would join a port a server of ours
            # already shares with SO_REUSEPORT), then held: a bind in between fails the hold.
            free = _free(host, port)
            hold = _hold(host, port) if held and free else None
            if not free or (held and hold is None):
                claim.close()
                continue
            _claims.append((now + hold_s, claim))
            while len(_claims) > _MAX_CLAIMS:
                _claims.pop(0)[1].close()
            out.append((port, hold))
            if len(out) == count:
                return out
        for _, hold in out:
            if hold is not None:
                hold.close()
    raise OSError(f"no {count} free ports on {host} in {ports.start}-{ports.stop - 1}")
