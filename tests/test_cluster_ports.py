"""Ports for local servers come from a range nothing else draws from, claimed host-wide."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

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
