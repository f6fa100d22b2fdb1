"""``network=True`` local sandboxes against real bubblewrap, slirp4netns and sockets.

The sandbox has a network namespace of its own wired to the host by slirp4netns: it must
reach neither the host's loopback nor the host's own addresses (where slirp would land on a
0.0.0.0 listener), and slirp4netns must never outlive the sandbox. No test sends a packet
off this machine: every listener is the test's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from modal_rl.sandboxes import LocalProvider, ProviderUnavailableError, SandboxPool, SandboxSpec, localnet
from tests._sandboxes_helpers import alive, descendants, needs_bwrap, sandbox_processes, wait_gone

pytestmark = [
    needs_bwrap,
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="slirp4netns not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
# Prints, per "addr:port" argument, "<addr>:<port> connected" or "... blocked <error>".
PROBE = (
    "import socket, sys\n"
    "for target in sys.argv[1:]:\n"
    "    addr, port = target.rsplit(':', 1)\n"
    "    s = socket.socket(); s.settimeout(3)\n"
    "    try:\n"
    "        s.connect((addr, int(port))); print(target, 'connected')\n"
    "    except OSError as e:\n"
    "        print(target, 'blocked', e)\n"
)


class Listener:
    """A TCP listener of the test's own that counts the connections it accepted."""

    def __init__(self, addr: str):
        self.sock = socket.socket()
        self.sock.bind((addr, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            conn.close()


async def _with_network_sandbox(tmp_path, body, network=True):
    provider = LocalProvider(registry_dir=tmp_path / "reg")
    sb = await provider.create(SandboxSpec(network=network), tags={"test": "net"})
    await asyncio.wait_for(sb.ready(), 10)
    helper = sb._net.proc.pid if sb._net is not None else None
    try:
        return await body(sb)
    finally:
        procs = descendants(sb.pid) | {sb.pid} | ({helper} if helper else set())
        await sb.terminate()
        assert not wait_gone(procs), "sandbox or slirp4netns survived terminate"
        assert not list((tmp_path / "reg").glob("*.json")), "registry entry left behind"


def run(tmp_path, body, network=True):
    return asyncio.run(_with_network_sandbox(tmp_path, body, network))


async def probe(sb, *targets: str) -> dict[str, str]:
    r = await sb.exec(["python3", "-c", PROBE, *targets], timeout_s=30)
    assert r.returncode == 0, r.stderr
    return {ln.split()[0]: ln.split(None, 1)[1] for ln in r.stdout.splitlines()}


def routes(text: str) -> list[tuple[str, str, str, int]]:
    """(iface, destination, gateway, flags) of each /proc/net/route line, addresses dotted."""

    def dotted(hex_le: str) -> str:
        return socket.inet_ntoa(int(hex_le, 16).to_bytes(4, "little"))

    out = []
    for ln in text.splitlines()[1:]:
        f = ln.split()
        out.append((f[0], dotted(f[1]), dotted(f[2]), int(f[3], 16)))
    return out


def run_beside(tmp_path, srv: Listener, body) -> int:
    """``body`` in a network=True sandbox while ``srv`` listens; the connections it accepted."""
    try:
        run(tmp_path, body)
    finally:
        srv.sock.close()
    return srv.accepted


def test_cannot_reach_the_hosts_loopback(tmp_path):
    srv = Listener("127.0.0.1")

    async def body(sb):
        seen = await probe(sb, f"127.0.0.1:{srv.port}", f"{localnet.GATEWAY}:{srv.port}")
        assert seen[f"127.0.0.1:{srv.port}"].startswith("blocked"), seen  # its own lo: nobody there
        assert seen[f"{localnet.GATEWAY}:{srv.port}"].startswith("blocked"), seen  # slirp refuses

    assert run_beside(tmp_path, srv, body) == 0


def test_cannot_reach_the_hosts_own_addresses(tmp_path):
    # A 0.0.0.0 listener also listens on the host's non-loopback addresses; slirp connects
    # from the host, so without the unreachable routes it would land there.
    srv = Listener("0.0.0.0")
    addrs = localnet.host_ipv4()

    async def body(sb):
        targets = [f"{a}:{srv.port}" for a in addrs] + [f"{localnet.GATEWAY}:{srv.port}"]
        seen = await probe(sb, *targets)
        assert all(v.startswith("blocked") for v in seen.values()), seen

    assert run_beside(tmp_path, srv, body) == 0


def test_slirp_alone_would_reach_the_hosts_address(tmp_path, monkeypatch):
    # What --disable-host-loopback does not cover (why the routes exist), and proof that slirp
    # carries the sandbox's outbound TCP: the same path a connection to the internet takes.
    addrs = localnet.host_ipv4()
    if not addrs:
        pytest.skip("this host has no non-loopback IPv4 address")
    monkeypatch.setattr(localnet, "host_ipv4", lambda: [])
    srv = Listener("0.0.0.0")

    async def body(sb):
        seen = await probe(sb, f"{addrs[0]}:{srv.port}", f"127.0.0.1:{srv.port}")
        assert seen[f"{addrs[0]}:{srv.port}"] == "connected", seen
        assert seen[f"127.0.0.1:{srv.port}"].startswith("blocked"), seen

    assert run_beside(tmp_path, srv, body) == 1


def test_has_an_interface_a_default_route_and_dns(tmp_path):
    async def body(sb):
        r = await sb.exec(["cat", "/proc/net/dev", "/proc/net/route", "/etc/resolv.conf"], timeout_s=10)
        dev, rest = r.stdout.split("Iface", 1)
        route_text, resolv = ("Iface" + rest).split("nameserver", 1)
        assert [ln.split(":")[0].strip() for ln in dev.splitlines()[2:]] == ["lo", "tap0"]
        table = routes(route_text)
        assert ("tap0", "0.0.0.0", localnet.GATEWAY, 0x3) in table  # default route, UP|GATEWAY
        rejected = {dst for _, dst, _, flags in table if flags & 0x200}  # RTF_REJECT: unreachable
        assert rejected == {*localnet.host_ipv4(), "169.254.0.0"}
        assert resolv.split()[0] == localnet.DNS

    run(tmp_path, body)


def test_network_false_has_only_lo(tmp_path):
    async def body(sb):
        r = await sb.exec(["cat", "/proc/net/dev", "/proc/net/route"], timeout_s=10)
        dev, route_text = r.stdout.split("Iface", 1)
        assert [ln.split(":")[0].strip() for ln in dev.splitlines()[2:]] == ["lo"]
        assert routes("Iface" + route_text) == []
        assert sb._net is None

    run(tmp_path, body, network=False)


def test_slirp_ends_with_a_sandbox_killed_from_outside(tmp_path):
    # A sweep's killpg reaches bwrap's group only; slirp4netns sees its exit pipe close.
    async def main():
        sb = await LocalProvider(registry_dir=tmp_path).create(SandboxSpec(network=True), tags={"t": "n"})
        helper = sb._net.proc.pid
        os.killpg(sb.pid, signal.SIGKILL)
        gone = await asyncio.to_thread(wait_gone, {helper})
        await sb.terminate()
        return gone

    assert not asyncio.run(main()), "slirp4netns outlived its sandbox"


CHILD = """
import asyncio, json, sys, time
from modal_rl.sandboxes import LocalProvider, SandboxSpec

async def main():
    sb = await LocalProvider(registry_dir=sys.argv[1]).create(SandboxSpec(network=True), tags={"t": "n"})
    await sb.ready()
    print(json.dumps({"bwrap": sb.pid, "slirp": sb._net.proc.pid}), flush=True)
    time.sleep(3600)

asyncio.run(main())
"""


def test_slirp_ends_with_a_killed_pool_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pids = json.loads(proc.stdout.readline())
        inner = descendants(pids["bwrap"])
        assert alive(pids["slirp"]) and inner
    finally:
        proc.kill()  # no cleanup code runs: bwrap dies with its parent, slirp with bwrap
        proc.wait(timeout=20)
    assert not wait_gone({pids["bwrap"], pids["slirp"], *inner}), "a process outlived the killed pool"


def test_cancelled_creates_and_a_pool_leave_nothing(tmp_path):
    fds = len(os.listdir("/proc/self/fd"))

    async def main():
        provider = LocalProvider(registry_dir=tmp_path)
        for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05):  # cancelled at points of the setup
            try:
                sb = await asyncio.wait_for(
                    provider.create(SandboxSpec(network=True), tags={"t": "c"}), delay
                )
            except TimeoutError:
                continue
            await sb.terminate()  # it was quicker than the delay
        spec = SandboxSpec(network=True)
        pool = SandboxPool(
            provider, spec, min_warm=2, rate_limiter=False, log_interval_s=0, handle_signals=False
        )
        helpers = set()
        async with pool, pool.lease() as sb:
            r = await sb.exec(["cat", "/proc/net/dev"], timeout_s=10)
            assert "tap0" in r.stdout
            helpers |= {h._net.proc.pid for h in pool._all.values() if h._net and h._net.proc}
        return helpers

    helpers = asyncio.run(main())
    assert not wait_gone(helpers | sandbox_processes()), "processes left behind"
    assert not list(tmp_path.glob("*.json"))
    assert len(os.listdir("/proc/self/fd")) == fds, "file descriptors leaked"


def test_missing_slirp4netns_is_a_clear_error(tmp_path):
    provider = LocalProvider(slirp4netns="definitely-not-slirp4netns", registry_dir=tmp_path)

    async def main():
        with pytest.raises(ProviderUnavailableError, match="apt-get install slirp4netns") as err:
            await provider.create(SandboxSpec(network=True), tags={"t": "m"})
        assert "\n" not in str(err.value)
        assert not sandbox_processes()
        sb = await provider.create(SandboxSpec(network=False), tags={"t": "m"})  # needs no slirp
        await sb.terminate()

    asyncio.run(main())
