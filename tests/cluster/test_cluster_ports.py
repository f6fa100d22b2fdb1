"""Ports for local servers come from a range nothing else draws from, claimed host-wide."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.cluster import ports


def test_ports_are_outside_the_kernels_ephemeral_range_and_rays_worker_ports():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    got = ports.reserve(50)
    assert len(set(got)) == 50
    assert all(19999 < p < low for p in got), got


def test_a_claimed_port_is_never_given_to_another_process():
    mine = set(ports.reserve(200))
    code = "from modal_rl.cluster import ports; print(*ports.reserve(2000))"
    theirs = set(
        map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split())
    )
    assert len(theirs) == 2000 and not mine & theirs


def test_a_port_in_use_is_not_free_and_a_claim_is_exclusive():
    (port,) = ports.reserve(1)
    assert ports._claim(port) is None  # held by us: no second claim, here or in another process
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        assert not ports._free("127.0.0.1", port)


def test_a_process_holds_a_bounded_number_of_claims():
    ports.reserve(ports._MAX_CLAIMS + 50)
    assert len(ports._claims) <= ports._MAX_CLAIMS


def test_a_local_ray_node_opens_no_port_of_rays_choosing():
    """Every port ``ray start`` would take from a default or at random is in the plan, claimed:
    the GCS, dashboard and control ports, each node's six per-node ports, the head's Ray client
    server, and the dashboard's metrics server (an environment variable in Ray 2.60)."""
    from modal_rl.cluster.backend import JobRequest
    from modal_rl.cluster.backend_local import LocalBackend
    from modal_rl.cluster.raynode import DASHBOARD_METRIC_PORT_ENV, node_environment, ray_start_argv
    from modal_rl.cluster.spec import ClusterSpec

    plan = LocalBackend().make_plan(ClusterSpec(nodes=3), JobRequest(["true"]))
    argvs = [ray_start_argv(plan, rank) for rank in range(3)]
    rays_own = [
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
    ]
    for rank, argv in enumerate(argvs):
        flags = {a.split("=")[0] for a in argv if a.startswith("--")}
        assert set(rays_own) <= flags, (rank, flags)
        assert ("--ray-client-server-port" in flags) == (rank == 0)
    numbers = [
        int(a.split("=")[1])
        for argv in argvs
        for a in argv
        if a.split("=")[0] in {*rays_own, "--ray-client-server-port", "--port", "--dashboard-port"}
    ]
    metrics = int(node_environment(plan, "lo")[DASHBOARD_METRIC_PORT_ENV])
    numbers += [metrics, plan.control_port]
    assert len(numbers) == 3 * 6 + 1 + 2 + 1 + 1 and len(set(numbers)) == len(numbers)
    span = ports.port_range()
    assert all(p in span for p in numbers), numbers


def test_a_held_port_refuses_a_plain_bind_and_passes_to_a_server_that_shares_it():
    ((port, hold),) = ports.reserve_held(1)
    try:
        with socket.socket() as plain:
            plain.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                plain.bind(("127.0.0.1", port))
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            hold.close()  # handed over: the server alone holds the port
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    finally:
        hold.close()
