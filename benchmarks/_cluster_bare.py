"""Baseline for suite ``cluster``: the same Ray nodes started with bare ``ray start`` commands.

What a user does by hand (and what Modal's own examples script): ``ray start --head``,
which returns once the head is up, then ``ray start --address=...`` for every other node
in parallel, then poll until all nodes are alive. Same flags as our bootstrap (pinned
loopback IP, per-node ports and temp dirs, logical GPUs), minus ``--block``, so the only
difference measured is our bootstrap's orchestration.
"""

from __future__ import annotations

import os
import subprocess
import time

from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.raynode import node_environment, ray_start_argv


def alive_nodes(dashboard_url: str) -> int:
    from ray.util.state import list_nodes

    nodes = list_nodes(address=dashboard_url, detail=True, timeout=5, raise_on_missing_output=False)
    return sum(1 for n in nodes if n.state == "ALIVE" and n.resources_total.get("GPU", 0) >= 1)


def bare_bringup(plan: BootstrapPlan, timeout_s: float = 300.0) -> float:
    """Seconds from the first ``ray start`` until all ``plan.nodes`` nodes are alive."""
    env = {**os.environ, **node_environment(plan, "lo")}
    argvs = [[a for a in ray_start_argv(plan, r) if a != "--block"] for r in range(plan.nodes)]
    started = time.monotonic()
    subprocess.run(argvs[0], env=env, check=True, capture_output=True, timeout=timeout_s)
    workers = [
        subprocess.Popen(a, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for a in argvs[1:]
    ]
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        try:
            if alive_nodes(plan.dashboard_url()) >= plan.nodes:
                break
        except Exception:
            pass
        time.sleep(0.25)
    else:
        raise TimeoutError(f"bare ray start: {plan.nodes} nodes not alive within {timeout_s} s")
    elapsed = time.monotonic() - started
    for proc in workers:
        proc.wait(timeout=60)
    return elapsed


def bare_first_output(plan: BootstrapPlan, started: float, marker: str) -> float:
    """After a bare bring-up: submit a job printing ``marker``; seconds from ``started`` to seeing it."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(plan.dashboard_url())
    job_id = client.submit_job(entrypoint=f"python -c \"print('{marker}', flush=True)\"")
    while True:
        if marker in client.get_job_logs(job_id):
            return time.monotonic() - started
        time.sleep(0.1)
