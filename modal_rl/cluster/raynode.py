"""One Ray node as a child process: ``ray start --block`` with its output read line by line.

``--block`` keeps ``ray start`` in the foreground, watching the GCS/raylet it spawned and
exiting when one of them dies, so the child's exit *is* the node's death and its output is
the node's log. The node IP is always pinned (``--node-ip-address``): left alone, Ray
advertises the host's outward address.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from modal_rl.cluster import procs
from modal_rl.cluster.plan import BootstrapPlan, hostport

# The ports a Ray node opens besides GCS and dashboard. Left alone, Ray takes them at random
# or from fixed defaults inside the kernel's ephemeral range (the dashboard agent's 52365, also
# bound on 127.0.0.1 whatever the node IP), so two nodes on one host, or any outgoing connection,
# can take them first: seen as "No available agent to submit job" and a head that exits.
_NODE_PORT_FLAGS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
)
# Ray 2.60 reads the dashboard's own metrics port (default 44227) only from the environment.
DASHBOARD_METRIC_PORT_ENV = "DASHBOARD_METRIC_PORT"


def claimed_node_ports(nodes: int, host: str) -> tuple[list[list[str]], dict[str, str]]:
    """Ports for ``nodes`` Ray nodes on one host, every one claimed (``ports.reserve``).

    Returns each rank's ``ray start`` flags (rank 0, the head, also gets the Ray client
    server's, default 10001) and the environment the head needs for its dashboard's metrics
    server. With the GCS and dashboard ports of the plan, a node opens no port of Ray's choice.
    """
    from modal_rl.cluster import ports

    picked = ports.reserve(nodes * len(_NODE_PORT_FLAGS) + 2, host)
    flags = []
    for rank in range(nodes):
        mine = picked[rank * len(_NODE_PORT_FLAGS) : (rank + 1) * len(_NODE_PORT_FLAGS)]
        flags.append([f"{flag}={port}" for flag, port in zip(_NODE_PORT_FLAGS, mine, strict=True)])
    flags[0].append(f"--ray-client-server-port={picked[-2]}")
    return flags, {DASHBOARD_METRIC_PORT_ENV: str(picked[-1])}


def ray_start_argv(plan: BootstrapPlan, rank: int) -> list[str]:
    """The ``ray start`` command line for ``rank`` (head when rank 0)."""
    address = plan.addresses[rank]
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    argv += [f"--node-ip-address={address}", f"--num-gpus={plan.gpus_per_node}"]
    argv += [f"--resources={json.dumps({plan.rank_resource(rank): 1})}"]
    if plan.cpus_per_node is not None:
        argv.append(f"--num-cpus={plan.cpus_per_node:g}")
    if plan.object_store_bytes is not None:
        argv.append(f"--object-store-memory={plan.object_store_bytes}")
    if plan.temp_root is not None:
        argv.append(f"--temp-dir={plan.temp_root}/r{rank}")
    if rank == 0:
        argv += ["--head", f"--port={plan.gcs_port}", "--include-dashboard=true"]
        argv += [
            f"--dashboard-host={plan.dashboard_host or address}",
            f"--dashboard-port={plan.dashboard_port}",
        ]
    else:
        argv.append(f"--address={hostport(plan.head_address(), plan.gcs_port)}")
    if plan.node_flags:
        argv += plan.node_flags[rank]
    return argv


# Imports Ray's CLI (seconds of CPU), then waits for one line on stdin before running it.
_PREWARM = (
    "import sys; from ray.scripts.scripts import main; sys.stdin.readline(); sys.argv[0] = 'ray'; main()"
)


class RayNode:
    """A running ``ray start --block``; ``lines`` holds its last output lines.

    With ``prewarm=True`` the process starts at once but only imports Ray's CLI, and runs
    ``ray start`` when ``go()`` is called: a follower pays the import while the head is
    still starting instead of after it (the command line is the same as without prewarm).
    """

    def __init__(
        self, argv: list[str], on_line: Callable[[str], None], tail: int = 30, prewarm: bool = False
    ):
        self.argv = argv
        self.lines: collections.deque[str] = collections.deque(maxlen=tail)
        self._on_line = on_line
        cmd = [argv[0], "-c", _PREWARM, *argv[3:]] if prewarm else argv
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if prewarm else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True, name="ray-node-output")
        self._reader.start()

    def go(self) -> None:
        """Release a prewarmed node (no-op otherwise)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write("\n")
                self.proc.stdin.close()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self._on_line(line)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM ``ray start`` (it ends its GCS/raylet), then SIGKILL whatever it left behind."""
        if self.proc.poll() is None:
            family = procs.children_of(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
            procs.signal_pids([self.proc.pid, *family], signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=2.0)


def node_environment(plan: BootstrapPlan, iface: str) -> dict[str, str]:
    """Variables every process of a node inherits (Ray passes its env on to its workers).

    Never the run key: this dict also becomes the job's runtime env, which Ray stores and
    serves (Job API); the key reaches Ray's processes by inheritance from the node process.
    The plan's auth mode is set last, so no user ``env`` entry can switch it.
    """
    from modal_rl.cluster.plan import BASE_ENV
    from modal_rl.cluster.procs import RUN_ID_ENV

    env = {**BASE_ENV, "NCCL_SOCKET_IFNAME": iface, "GLOO_SOCKET_IFNAME": iface, RUN_ID_ENV: plan.run_id}
    env.update(plan.env)
    env["RAY_AUTH_MODE"] = plan.ray_auth
    return env


def apply_environment(env: dict[str, str]) -> None:
    os.environ.update(env)
