"""A local Ray node for tests that drive verl's Ray actors directly.

The node is a ``ray start --head --block`` child, not ``ray.init(address="local")``: an
in-process head cannot be given its dashboard agent's port, and Ray's default (52365, in the
kernel's ephemeral range, bound on 127.0.0.1 by every node) is taken by whichever node or
outgoing connection comes first. Here every port the node opens is claimed
(``raynode.claimed_node_ports``), and the node's processes carry a run id, so teardown ends
exactly them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from modal_rl import run_temp
from modal_rl.cluster import ports, procs
from modal_rl.cluster.raynode import claimed_node_ports


class LocalRay:
    """Ray nodes on ``address``, each a ``ray start --block`` child carrying ``MODAL_RL_RUN_ID``."""

    def __init__(self, address: str):
        self.address = address
        self.run_id = "lr" + uuid.uuid4().hex[:10]
        self.temp = str(run_temp.make())  # Ray's node dirs and every node process's TMPDIR
        self.gcs_port = ports.reserve(1, address)[0]
        self.children: list[subprocess.Popen] = []
        self.env = {**os.environ, **run_temp.child_env(self.temp), procs.RUN_ID_ENV: self.run_id}
        self.env["RAY_AUTH_MODE"] = "disabled"

    def start_node(self, gpus: int, cpus: int, head: bool = False, resources=None) -> subprocess.Popen:
        import json

        (flags,), head_env = claimed_node_ports(1, self.address)
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
        argv += [f"--node-ip-address={self.address}", f"--num-gpus={gpus}", f"--num-cpus={cpus}"]
        argv += ["--object-store-memory=80000000", f"--temp-dir={self.temp}/n{len(self.children)}"]
        argv += flags if head else [f for f in flags if not f.startswith("--ray-client-server-port")]
        if resources:
            argv += [f"--resources={json.dumps(resources)}"]
        if head:
            argv += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}:{self.gcs_port}"]
        child = subprocess.Popen(
            argv,
            env={**self.env, **head_env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.children.append(child)
        return child

    def wait_for_gcs(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((self.address, self.gcs_port), 1):
                return
            if self.children and self.children[0].poll() is not None:
                raise AssertionError(f"the Ray head exited with {self.children[0].returncode}")
            time.sleep(0.25)
        raise AssertionError(f"the Ray head's GCS did not listen within {timeout_s} s")

    def close(self) -> list[int]:
        survivors = procs.end_run(self.run_id)
        for child in self.children:
            child.wait(timeout=10)
        run_temp.remove(self.temp)
        return survivors


@contextlib.contextmanager
def loopback_ray(tmp_path_factory, num_cpus: int, env_vars: dict[str, str]) -> Iterator:
    """``ray`` attached to a head on 127.0.0.1 (auth off: loopback only), ended at the end;
    skips the test when this process already runs Ray. Ray's session dir and its workers'
    temp files go to a run dir that is removed at the end (``modal_rl.run_temp``); pytest's
    own temp root is fixed first, so it stays where it was."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray runtime is already initialized in this process")
    tmp_path_factory.getbasetemp()
    with run_temp.process_temp():  # the driver's own temp files too
        local = LocalRay("127.0.0.1")
        try:
            local.start_node(gpus=0, cpus=num_cpus, head=True)
            local.wait_for_gcs()
            ray.init(
                address=f"{local.address}:{local.gcs_port}",
                _node_ip_address=local.address,
                runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", **env_vars}},
                log_to_driver=False,
            )
            yield ray
        finally:
            ray.shutdown()
            assert local.close() == []
