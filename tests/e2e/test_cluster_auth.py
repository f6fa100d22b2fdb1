"""Ray token auth on a real 2-node local cluster (loopback), the Modal cluster's bring-up.

``LocalBackend(ray_auth="token")`` runs the same bootstrap a Modal container runs with
``RAY_AUTH_MODE=token`` and the run key as Ray's token: rank 0's Job API client, log tail
and state-API polling, and the follower joining all authenticate. While the job runs, a
client without the key or with a wrong one is refused by the dashboard's Job API and by the
GCS, and nothing it asked for happens; the key is on no command line and in no log.

One cluster serves the whole module (a bring-up costs 20-40 s on a busy 2-core host); the
job waits for a sentinel file, which the last test creates.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from modal_rl.cluster import procs
from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backend_local import LocalBackend
from modal_rl.cluster.spec import ClusterSpec
from modal_rl.run_key import RAY_TOKEN_ENV, RUN_KEY_ENV, engine_bearer, new_run_key, ray_token
from tests.e2e.test_cluster_local import JOIN_S, Lines, _assert_nothing_left

pytestmark = pytest.mark.slow

# The job: attach to the cluster (the driver authenticates with the node's token), check that
# a Ray worker on the follower has the run key (by hash: the key itself is never printed),
# then wait for the test's sentinel.
JOB = """
import hashlib, os, sys, time
import ray
ray.init()
digest = lambda: hashlib.sha256(os.environ.get("MODAL_RL_RUN_KEY", "").encode()).hexdigest()
@ray.remote(num_cpus=0, resources={"modal_rl_rank_1": 0.01})
def far():
    return digest(), os.environ.get("RAY_AUTH_MODE")
theirs, mode = ray.get(far.remote())
print("WORKER_ON_RANK_1", theirs == digest() != hashlib.sha256(b"").hexdigest(), mode, flush=True)
print("JOB_STARTED", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.2)
print("JOB_DONE", flush=True)
"""

# A GCS client that tries to write a key: the GCS must refuse it before anything is stored.
GCS_PROBE = """
import sys
try:
    from ray._raylet import GcsClient
    client = GcsClient(address=sys.argv[1])
    client.internal_kv_put(b"modal_rl_probe", b"pwned", True, namespace=None, timeout=15)
    print("WROTE")
except Exception as exc:
    print("REFUSED", type(exc).__name__)
"""


class Run:
    def __init__(self, tmp: Path):
        self.key = new_run_key()
        self.sentinel = tmp / "go"
        self.out, self.err = Lines(), Lines()
        self.backend = LocalBackend(on_line=self.out, on_err=self.err, ray_auth="token")
        script = tmp / "job.py"
        script.write_text(JOB)
        job = JobRequest([sys.executable, str(script), str(self.sentinel)])
        self.plan = self.backend.make_plan(ClusterSpec(nodes=2, join_timeout_s=JOIN_S), job)
        self.url = f"http://{self.plan.addresses[0]}:{self.plan.dashboard_port}"
        self.gcs = f"{self.plan.addresses[0]}:{self.plan.gcs_port}"
        self.result: dict = {}
        self.thread = threading.Thread(
            target=lambda: self.result.update(code=self.backend.run_plan(self.plan))
        )

    def release(self) -> None:
        self.sentinel.touch()
        self.thread.join(timeout=120)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    saved = {k: os.environ.get(k) for k in (RUN_KEY_ENV, RAY_TOKEN_ENV)}
    r = Run(tmp)
    os.environ[RUN_KEY_ENV] = r.key  # as a launcher does (contract 1); node processes inherit it
    os.environ.pop(RAY_TOKEN_ENV, None)  # the bootstrap derives Ray's token from the run key
    r.thread.start()
    deadline = time.monotonic() + JOIN_S + 120
    while r.out.first("JOB_STARTED") is None and r.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert r.out.first("JOB_STARTED") is not None, r.err.text()[-3000:]
        yield r
    finally:
        r.release()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        procs.end_run(r.plan.run_id)


def _post_job(url: str, headers: dict[str, str]) -> int:
    body = json.dumps({"entrypoint": "echo pwned"}).encode()
    req = urllib.request.Request(
        url + "/api/jobs/", data=body, headers={"Content-Type": "application/json", **headers}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _stranger_env(tmp: Path, token: str | None) -> dict[str, str]:
    """This machine's env without the run's key; HOME elsewhere, so no ~/.ray/auth_token."""
    env = {
        k: v for k, v in os.environ.items() if k not in (RUN_KEY_ENV, RAY_TOKEN_ENV, "RAY_AUTH_TOKEN_PATH")
    }
    env.update(HOME=str(tmp), RAY_AUTH_MODE="token" if token else "disabled")
    if token:
        env[RAY_TOKEN_ENV] = token
    return env


def test_the_job_ran_with_auth_on_and_workers_on_every_node_have_the_key(run):
    assert "WORKER_ON_RANK_1 True token" in run.out.text()  # Ray workers inherit key and mode
    assert "all 2 nodes joined" in run.err.text()  # the follower joined the authenticated GCS


def test_job_api_refuses_a_client_without_the_key_and_nothing_is_submitted(run):
    assert _post_job(run.url, {}) == 401
    assert _post_job(run.url, {"Authorization": "Bearer " + new_run_key()}) == 403
    assert _post_job(run.url, {"X-Ray-Authorization": "Bearer wrong"}) == 403
    with pytest.raises(urllib.error.HTTPError) as info:  # reading the jobs is refused too
        urllib.request.urlopen(run.url + "/api/jobs/", timeout=20)
    assert info.value.code == 401
    from ray.job_submission import JobSubmissionClient

    # Round 3: Ray's token is derived (``ray_token``); a leaked engine bearer, or the run key
    # itself, submits nothing.
    assert _post_job(run.url, {"Authorization": "Bearer " + engine_bearer(run.key)}) == 403
    assert _post_job(run.url, {"Authorization": "Bearer " + run.key}) == 403
    client = JobSubmissionClient(run.url, headers={"Authorization": f"Bearer {ray_token(run.key)}"})
    jobs = client.list_jobs()
    assert len(jobs) == 1 and "job.py" in jobs[0].entrypoint  # ours only: nothing was submitted


def test_gcs_refuses_a_connection_without_the_token(run, tmp_path):
    probes = {
        "no token": [sys.executable, "-c", GCS_PROBE, run.gcs],
        "wrong token": [sys.executable, "-c", GCS_PROBE, run.gcs],
        "ray.init without token": [sys.executable, "-c", f"import ray; ray.init(address={run.gcs!r})"],
    }
    envs = {
        "no token": _stranger_env(tmp_path, None),
        "wrong token": _stranger_env(tmp_path, new_run_key()),
        "ray.init without token": _stranger_env(tmp_path, None),
    }
    started = {
        name: subprocess.Popen(
            argv, env=envs[name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, argv in probes.items()
    }
    results = {name: p.communicate(timeout=120) for name, p in started.items()}
    for name in ("no token", "wrong token"):
        assert results[name][0].startswith("REFUSED"), (name, results[name])
    assert started["ray.init without token"].returncode != 0
    assert "Failed to connect to Ray cluster" in results["ray.init without token"][1]
    # With the key, the GCS answers, and holds nothing the strangers tried to write.
    check = (
        "import sys; from ray._raylet import GcsClient; "
        "print(GcsClient(address=sys.argv[1]).internal_kv_get(b'modal_rl_probe', namespace=None, timeout=15))"
    )
    owner = {**_stranger_env(tmp_path, ray_token(run.key))}  # the Ray token: derived (round 3)
    done = subprocess.run(
        [sys.executable, "-c", check, run.gcs], env=owner, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "None", done.stderr[-2000:]


def test_key_is_on_no_command_line_of_the_run(run):
    pids = procs.pids_of_run(run.plan.run_id)
    names = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            names.add(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
        assert run.key.encode() not in cmdline, (pid, cmdline[:200])
    assert {"gcs_server", "raylet"} <= names  # the scan saw Ray's own processes
    assert len(pids) >= 8
    # Ray's session logs of every node, while the run is up.
    for path in Path(run.plan.temp_root).rglob("*"):
        if path.is_file():
            try:
                assert run.key.encode() not in path.read_bytes(), path
            except OSError:
                continue


def test_job_ends_cleanly_and_no_output_holds_the_key(run):
    run.release()
    assert run.result.get("code") == 0, run.err.text()[-3000:]
    assert "JOB_DONE" in run.out.text()  # streamed through the authenticated log tail
    digest = hashlib.sha256(run.key.encode()).hexdigest()
    for text in (run.out.text(), run.err.text()):
        assert run.key not in text and digest not in text
    _assert_nothing_left(run.backend)
