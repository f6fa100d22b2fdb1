"""Which network interface carries an address: the value for NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME.

NCCL and Gloo pick an interface on their own and often pick the wrong one (Gloo falls back
to loopback, NCCL to a docker bridge); both honour ``*_SOCKET_IFNAME``. We name the interface
that holds the node's cluster address, found from the kernel (IPv4 via SIOCGIFADDR/netmask
ioctls, IPv6 via ``/proc/net/if_inet6``), so the collectives use the same network Ray does.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def _ipv4_networks() -> list[tuple[str, ipaddress.IPv4Interface]]:
    nets = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK, packed)[20:24])
            except OSError:
                continue  # interface without an IPv4 address
            nets.append((name, ipaddress.IPv4Interface(f"{addr}/{mask}")))
    return nets


def _ipv6_addresses() -> list[tuple[str, ipaddress.IPv6Interface]]:
    out = []
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, prefix, _, _, name = line.split()
                addr = ipaddress.IPv6Address(int(hexaddr, 16))
                out.append((name, ipaddress.IPv6Interface(f"{addr}/{int(prefix, 16)}")))
    except FileNotFoundError:
        pass
    return out


def interface_for(address: str) -> str:
    """Name of the local interface whose network contains ``address`` (exact address first).

    Raises ``LookupError`` naming the address when no interface holds it: a node must only
    be told to use an address that is its own.
    """
    ip = ipaddress.ip_address(address)
    candidates = _ipv4_networks() if ip.version == 4 else _ipv6_addresses()
    # An exact host match beats a subnet match (two interfaces may share a subnet).
    for name, iface in candidates:
        if iface.ip == ip:
            return name
    for name, iface in sorted(candidates, key=lambda c: -c[1].network.prefixlen):
        if ip in iface.network:
            return name
    known = ", ".join(f"{n}={iface}" for n, iface in candidates) or "none"
    raise LookupError(f"no local interface carries {address} (interfaces: {known})")
