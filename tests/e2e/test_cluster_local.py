"""Real multi-node Ray clusters on localhost, through the same bootstrap Modal containers run.

Each test brings up real Ray nodes (separate processes, loopback only) and checks, after
teardown, that no process carrying the run's id is left. Sizes are minimal because a
bring-up takes 10-40 s on a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from modal_rl.cluster import procs
from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backend_local import LOOPBACK, LocalBackend
from modal_rl.cluster.plan import EXIT_FOLLOWER_LOST, EXIT_JOIN_TIMEOUT
from modal_rl.cluster.spec import ClusterSpec

pytestmark = pytest.mark.slow
JOIN_S = 150.0  # generous: other jobs share these 2 cores


class Lines:
    """Collects (time, line) from a backend's output callbacks."""

    def __init__(self, echo=sys.stderr):
        self.items: list[tuple[float, str]] = []
        self.echo = echo

    def __call__(self, line: str) -> None:
        self.items.append((time.monotonic(), line))
        print(line, file=self.echo, flush=True)

    def text(self) -> str:
        return "\n".join(line for _, line in self.items)

    def first(self, needle: str) -> float | None:
        return next((t for t, line in self.items if needle in line), None)


def _assert_nothing_left(backend: LocalBackend) -> None:
    assert backend.last_run_id
    assert procs.pids_of_run(backend.last_run_id) == []
    assert procs.alive(list(backend.started_pids.values())) == []


def test_smoke_three_nodes_prints_one_json_line_and_leaves_nothing():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "modal_rl.cluster", "smoke", "--nodes", "3", "--join-timeout", str(JOIN_S)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout + result.stderr[-3000:]
    report = json.loads(lines[0])
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["nodes_alive"] == 3 and report["allreduce_ok"] is True
    assert report["allreduce_value"] == 6.0  # 1 + 2 + 3: every rank took part
    assert report["node_ips"] == [LOOPBACK]  # Ray reports the pinned loopback address only
    assert report["iface"] == "lo"  # GLOO_SOCKET_IFNAME: the interface of the cluster address
    assert report["leftover_pids"] == 0
    assert procs.pids_of_run(report["run_id"]) == []


def test_failing_entrypoint_exit_code_propagates_after_a_collective_check():
    out, err = Lines(), Lines()
    backend = LocalBackend(on_line=out, on_err=err)
    job = JobRequest(
        [sys.executable, "-c", "import sys; print('about to fail', flush=True); sys.exit(7)"],
        collective_check=True,
    )
    code = backend.run(ClusterSpec(nodes=2, join_timeout_s=JOIN_S), job)
    assert code == 7
    assert "collective check passed" in err.text()  # all-reduce across both nodes ran first
    assert "about to fail" in out.text()  # the job's logs were tailed to us
    assert backend.follower_exit_codes == {1: 0}  # the follower left on rank 0's word, not by teardown
    _assert_nothing_left(backend)


def test_join_timeout_names_the_missing_rank():
    err = Lines()
    backend = LocalBackend(on_err=err)
    # Rank 1 is never started: rank 0 must give up at the join timeout and name it.
    plan = backend.make_plan(ClusterSpec(nodes=2, join_timeout_s=20), JobRequest(["true"]))
    code = backend.run_plan(plan, ranks=[0])
    assert code == EXIT_JOIN_TIMEOUT
    text = err.text()
    assert "ranks [1] did not join within 20 s of the head coming up" in text
    assert "rank 1: no contact from its node process" in text
    _assert_nothing_left(backend)


def test_follower_killed_mid_job_is_reported_at_rank_0_with_its_rank():
    out, err = Lines(), Lines()
    backend = LocalBackend(on_line=out, on_err=err)
    job = JobRequest([sys.executable, "-c", "import time; print('JOB_STARTED', flush=True); time.sleep(300)"])
    result: dict = {}
    runner = threading.Thread(
        target=lambda: result.update(code=backend.run(ClusterSpec(nodes=2, join_timeout_s=JOIN_S), job))
    )
    runner.start()
    deadline = time.monotonic() + JOIN_S + 60
    while out.first("JOB_STARTED") is None and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert out.first("JOB_STARTED") is not None, err.text()[-3000:]
    # Kill rank 1's whole node (its process, `ray start` and raylet) as a dying container would.
    follower = backend.started_pids[1]
    killed_at = time.monotonic()
    os.killpg(follower, signal.SIGKILL)
    runner.join(timeout=120)
    assert not runner.is_alive()
    reported_at = err.first("rank 1 lost")
    assert reported_at is not None, err.text()[-3000:]
    assert reported_at - killed_at < 10.0
    assert result["code"] == EXIT_FOLLOWER_LOST
    assert "last lines from rank 1" in err.text()
    _assert_nothing_left(backend)


def test_ctrl_c_tears_the_cluster_down():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "modal_rl.cluster", "smoke", "--nodes", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    run_ids: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in procs.children_of(proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            run_ids |= {e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"MODAL_RL_RUN_ID=")}
        # Wait until Ray itself is running (a raylet or GCS among the children), then interrupt.
        names = [_comm(pid) for pid in procs.children_of(proc.pid)]
        if run_ids and any(n in ("gcs_server", "raylet") for n in names):
            break
        time.sleep(0.3)
    assert run_ids, "the smoke run never started its nodes"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0
    for run_id in run_ids:
        assert procs.pids_of_run(run_id) == []


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
