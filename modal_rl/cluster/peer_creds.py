"""Who holds the other end of a loopback TCP socket: the owner uid, from the kernel's table.

Loopback is not a trust boundary: every local user reaches 127.0.0.1. Before we send a
credential to a loopback listener (an engine's readiness probe) or accept a loopback client
as one of ours (the key forwarder), we ask the kernel which user owns that socket
(``/proc/net/tcp`` and ``tcp6``, the ``uid`` column) and deal only with our own. A process of
our own user can read our keys anyway, so the uid is the boundary that counts against other
users; against our own processes that are not the engine (one that bound a reserved port
first), ``held_by_tree`` asks whether the listening socket belongs to the engine's process tree.

Invariants: a socket the table does not show (gone, or no ``/proc``) is ``None``, never ours;
addresses are compared exactly (an IPv4-mapped IPv6 address as its IPv4 form).
"""

from __future__ import annotations

import ipaddress
import os

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"
ESTABLISHED = "01"


def _address(field: str) -> tuple[str, int]:
    hexip, hexport = field.split(":")
    raw = bytes.fromhex(hexip)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(hexport, 16)


def _rows():
    for table in TABLES:
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 8:
                continue
            try:
                yield _address(parts[1]), _address(parts[2]), parts[3], int(parts[7]), parts[9]
            except (ValueError, IndexError):
                continue


def _norm(host: str) -> str:
    ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def listener_uid(host: str, port: int) -> int | None:
    """The uid owning the socket listening on ``host:port`` (or on a wildcard at ``port``)."""
    want = _norm(host)
    wildcard = {"0.0.0.0", "::"}
    for (lip, lport), _, state, uid, _inode in _rows():
        if state == LISTEN and lport == int(port) and (lip == want or lip in wildcard):
            return uid
    return None


def listener_inodes(host: str, port: int) -> set[str]:
    """The socket inodes listening on ``host:port`` (or on a wildcard at ``port``)."""
    want, wildcard = _norm(host), {"0.0.0.0", "::"}
    return {
        inode
        for (lip, lport), _, state, _uid, inode in _rows()
        if state == LISTEN and lport == int(port) and (lip == want or lip in wildcard)
    }


def held_by_tree(host: str, port: int, pid: int) -> bool | None:
    """Whether every listener on ``host:port`` is a socket of process ``pid`` or one of its
    descendants (None: nothing listens there yet). Our own user's processes are not all the
    engine: a process of ours that bound the port first is not it, and gets no credential.
    A socket is known by its inode (the table's ``inode`` column, ``socket:[N]`` in
    ``/proc/<pid>/fd``); a process whose descriptors cannot be read holds nothing."""
    inodes = listener_inodes(host, port)
    if not inodes:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    links = {f"socket:[{inode}]" for inode in inodes}
    found: set[str] = set()
    for proc in tree:
        try:
            fds = os.listdir(f"/proc/{proc.pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                found.add(os.readlink(f"/proc/{proc.pid}/fd/{fd}"))
            except OSError:
                continue
    # Every listener: a process of ours sharing the port (SO_REUSEPORT) would get its share.
    return links <= found


def peer_uid(ours: tuple, theirs: tuple) -> int | None:
    """The uid owning the far end of our connection ``ours`` (local) <-> ``theirs`` (peer)."""
    mine, peer = (_norm(ours[0]), int(ours[1])), (_norm(theirs[0]), int(theirs[1]))
    for local, remote, state, uid, _inode in _rows():
        if state == ESTABLISHED and local == peer and remote == mine:
            return uid
    return None


def is_ours(uid: int | None) -> bool:
    return uid is not None and uid == os.geteuid()


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(_norm(host)).is_loopback
    except ValueError:
        return False
