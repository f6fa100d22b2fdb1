"""Which network interface carries an address: the value for NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME.

NCCL and Gloo pick an interface on their own and often pick the wrong one (Gloo falls back
to loopback, NCCL to a docker bridge); both honour ``*_SOCKET_IFNAME``. We name the interface
that holds the node's cluster address, as the kernel reports it (``psutil.net_if_addrs``), so
the collectives use the same network Ray does.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil


def _networks(version: int) -> list[tuple[str, ipaddress.IPv4Interface | ipaddress.IPv6Interface]]:
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family != family:
                continue
            addr = a.address.split("%", 1)[0]  # fe80::1%eth0: the scope is the interface itself
            # The prefix length from the netmask: ipaddress takes "addr/mask" for both families.
            prefix = bin(int(ipaddress.ip_address(a.netmask))).count("1") if a.netmask else None
            out.append((name, ipaddress.ip_interface(addr if prefix is None else f"{addr}/{prefix}")))
    return out


def interface_for(address: str) -> str:
    """Name of the local interface whose network contains ``address`` (exact address first).

    Raises ``LookupError`` naming the address when no interface holds it: a node must only
    be told to use an address that is its own.
    """
    ip = ipaddress.ip_address(address)
    candidates = _networks(ip.version)
    # An exact host match beats a subnet match (two interfaces may share a subnet).
    for name, iface in candidates:
        if iface.ip == ip:
            return name
    for name, iface in sorted(candidates, key=lambda c: -c[1].network.prefixlen):
        if ip in iface.network:
            return name
    known = ", ".join(f"{n}={iface}" for n, iface in candidates) or "none"
    raise LookupError(f"no local interface carries {address} (interfaces: {known})")


# A TEST-NET-3 address (RFC 5737): only used to ask the kernel which source address its
# default route would use; a UDP ``connect`` sends no packet.
_ROUTE_PROBE = ("203.0.113.1", 9)


def ingress_ipv4() -> str:
    """This host's IPv4 address on its default route: the interface Modal's tunnel ingress
    reaches (a container's ``eth0``), so a server bound there is reachable through
    ``modal.forward`` without listening on every interface (``0.0.0.0``). ``RuntimeError``
    (one line) when the host has no IPv4 default route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(_ROUTE_PROBE)
            address = probe.getsockname()[0]
        except OSError as exc:
            raise RuntimeError(f"no IPv4 default route to bind a tunnel's server to ({exc})") from None
    if address in ("0.0.0.0", "") or ipaddress.ip_address(address).is_loopback:
        raise RuntimeError(f"the IPv4 default route's source address is {address!r}: no ingress interface")
    return address
