"""Ranks 1..N-1: join rank 0's Ray cluster and stay until rank 0 says the job is over.

A follower connects to rank 0's control port first (so even a node that never gets Ray up
is heard of), waits until rank 0 announces that its head node is registered, runs ``ray start --block``, forwards each of its
output lines, sends a heartbeat every ``heartbeat_s``, and exits:

- 0 when rank 0 sends ``exit`` (its Ray node is stopped first);
- the Ray node's exit code (or 1) when the node dies on its own after rank 0 announced that
  all nodes joined (rank 0 is told first); before that, a failed start is retried;
- 1 when the control connection to rank 0 breaks (the head is gone: nothing to serve).
"""

from __future__ import annotations

import sys
import time

from modal_rl.cluster.control import ControlClient
from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.raynode import RayNode, ray_start_argv
from modal_rl.run_key import redact


def _say(rank: int, msg: str) -> None:
    print(redact(f"[modal_rl.cluster rank {rank}] {msg}"), file=sys.stderr, flush=True)


def run_follower(plan: BootstrapPlan, rank: int) -> int:
    head = plan.head_address()
    try:
        control = ControlClient(
            head, plan.control_port, rank, connect_timeout_s=plan.head_timeout_s, heartbeat_s=plan.heartbeat_s
        )
    except ConnectionError as exc:
        _say(rank, str(exc))
        return 1

    def forward(line: str) -> None:
        line = redact(line)  # Ray's output goes to logs and to rank 0's failure reports
        print(f"[rank {rank} ray] {line}", file=sys.stderr, flush=True)
        control.send({"log": line})

    # Ray's CLI is imported now, but `ray start` runs only once rank 0 reports its head
    # node up (see control.py for why).
    nodes = [RayNode(ray_start_argv(plan, rank), on_line=forward, prewarm=True)]
    deadline = time.monotonic() + plan.head_timeout_s
    while True:
        msg = control.poll(0.5)
        if isinstance(msg, dict) and msg.get("head_up"):
            break
        if msg is False or time.monotonic() > deadline:
            _say(rank, "rank 0 never announced its head node; stopping")
            nodes[-1].stop()
            control.close()
            return 1
    nodes[-1].go()
    deadline = time.monotonic() + plan.join_timeout_s
    try:
        return _serve(plan, rank, control, nodes, deadline, forward)
    finally:
        nodes[-1].stop()
        control.close()


def _serve(
    plan: BootstrapPlan, rank: int, control: ControlClient, nodes: list, deadline: float, forward
) -> int:
    joined = False
    while True:
        code = nodes[-1].poll()
        if code is not None:
            time.sleep(0.2)  # let the reader thread forward the node's last words first
            if not joined and time.monotonic() < deadline - 5.0:
                # Before the cluster is complete a failed start is retried: on a busy host
                # `ray start` gives up after a fixed 30 s wait for its raylet to register.
                _say(rank, f"Ray node exited with code {code} during bring-up; starting it again")
                nodes.append(RayNode(ray_start_argv(plan, rank), on_line=forward))
                continue
            control.send({"ray_exited": code})
            _say(rank, f"Ray node exited with code {code}")
            return code or 1
        msg = control.poll(plan.heartbeat_s)
        if msg is False or control.broken.is_set():
            _say(rank, "rank 0 is gone (control connection closed); stopping")
            return 1
        if isinstance(msg, dict) and msg.get("joined"):
            joined = True
        if isinstance(msg, dict) and "exit" in msg:
            return 0
