"""Local backend: N Ray nodes on this machine, each a ``python -m modal_rl.cluster.node`` process.

Every node runs the same ``bootstrap`` as a Modal container. What differs, and why:

- address ``127.0.0.2`` for every node. Ray rewrites the literal ``127.0.0.1``/``localhost``
  to the host's outward address (``resolve_ip_for_localhost``, ``canonicalize_bootstrap_address``)
  and would then send cluster traffic to it; any other 127/8 address is loopback too
  (interface ``lo``) and Ray keeps it verbatim;
- distinct ports per node (GCS, dashboard, control, node/object manager, agents, metrics),
  picked free on the loopback address, since all nodes share one network namespace;
- a Ray temp dir per node, because nodes sharing a session dir race for socket names;
- the run's temp root (``<temp>/mrl-<run id>``, ``/tmp`` when the temp dir's path is long) is also every node process's ``TMPDIR``
  (``modal_rl.run_temp``), so what Ray workers, vLLM engines and torch write to "the temp
  directory" goes there, and it is removed with the run (kept under ``MODAL_RL_KEEP_LOGS``);
- logical GPUs (``--num-gpus``) so GPU-scheduled frameworks place their workers;
- Ray's token auth off by default: every port is bound to loopback, reachable only from
  this machine, where a user who can reach it could read the run key from our processes'
  environment anyway. ``ray_auth="token"`` (or ``MODAL_RL_RAY_AUTH=token``) turns it on,
  which runs the Modal cluster's authenticated bring-up here;
- the run key reaches node processes through their environment, never their argv;
- teardown at exit, on error and on Ctrl-C/SIGTERM ends exactly the processes whose
  environment carries this run's ``MODAL_RL_RUN_ID`` (see ``procs.py``);
- ``spec.retries``: a run that lost a node is started again on a fresh cluster (new run id,
  new ports), as Modal's function retries would (see ``retries.py``); ``retry_log`` records
  each attempt.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import modal_rl
from modal_rl import run_temp
from modal_rl.cluster import ports, procs
from modal_rl.cluster.backend import ClusterBackend, JobRequest, plan_from
from modal_rl.cluster.plan import RAY_AUTH_SWITCH_ENV, BootstrapPlan
from modal_rl.cluster.raynode import claimed_node_ports, node_environment, ray_start_argv
from modal_rl.cluster.retries import RetryLog, run_with_retries
from modal_rl.cluster.spec import ClusterSpec
from modal_rl.run_key import RAY_TOKEN_ENV, REDACTED, RUN_KEY_ENV, ensure_run_key, redact

LOOPBACK = "127.0.0.2"
REPO_ROOT = Path(modal_rl.__file__).resolve().parent.parent


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free on ``host``, claimed for this process (``ports.reserve``:
    from a range the kernel never hands out by itself, so nothing takes them before we bind)."""
    return ports.reserve(count, host)


class LocalBackend(ClusterBackend):
    """``on_line`` gets rank 0's stdout (the job's logs) line by line, ``on_err`` its stderr
    (bring-up and failure reports); defaults: our stdout and stderr. Followers' output goes
    to ``<temp_root>/rank-<i>.log`` (rank 0 reports their last lines when they fail)."""

    name = "local"
    detach_note = "a local cluster lives as long as the process that started it"

    def __init__(
        self,
        on_line: Callable[[str], None] | None = None,
        on_err: Callable[[str], None] | None = None,
        object_store_mb: int = 80,
        ray_auth: str | None = None,
    ):
        self.on_line = on_line or _writer(sys.stdout)
        self.on_err = on_err or _writer(sys.stderr)
        self.object_store_mb = object_store_mb
        # None: MODAL_RL_RAY_AUTH from the environment, else "disabled" (loopback only).
        self.ray_auth = ray_auth
        self.last_run_id: str | None = None
        self.started_pids: dict[int, int] = {}
        self.follower_exit_codes: dict[int, int | None] = {}
        self.retry_log = RetryLog()

    def make_plan(self, spec: ClusterSpec, job: JobRequest) -> BootstrapPlan:
        n = spec.nodes
        gcs, dashboard, control = free_ports(3)
        flags, head_env = claimed_node_ports(n, LOOPBACK)
        plan = plan_from(
            spec,
            job,
            addresses=[LOOPBACK] * n,
            gcs_port=gcs,
            dashboard_port=dashboard,
            control_port=control,
            node_flags=flags,
            cpus_per_node=spec.cpu if spec.cpu is not None else 1,
            object_store_bytes=self.object_store_mb * 1024 * 1024,
            ray_auth=self.ray_auth or os.environ.get(RAY_AUTH_SWITCH_ENV) or "disabled",
        )
        plan.env = {**head_env, **plan.env}
        # Short on purpose: Ray's unix socket paths live under it and must stay < 108 bytes.
        plan.temp_root = os.path.join(run_temp.base_dir(), f"{run_temp.PREFIX}{plan.run_id}")
        return plan

    def describe(self, spec: ClusterSpec, job: JobRequest) -> dict[str, Any]:
        plan = self.make_plan(spec, job)
        return {
            "backend": self.name,
            "spec": spec.to_dict(),
            "image": None,
            "addresses": plan.addresses,
            "commands": [node_command(Path(plan.temp_root) / "plan.json", r) for r in range(plan.nodes)],
            "ray_start": [ray_start_argv(plan, r) for r in range(plan.nodes)],
            "env": {**node_environment(plan, "lo"), **_key_entries(plan)},
            "ray_auth": plan.ray_auth,
            "dashboard": f"loopback only ({plan.addresses[0]}:{plan.dashboard_port})"
            + (", token required" if plan.ray_auth == "token" else ", auth off"),
            "entrypoint": plan.entrypoint,
            "runtime_env": plan.runtime_env,
        }

    def run(self, spec: ClusterSpec, job: JobRequest) -> int:
        self.retry_log = RetryLog()

        def once() -> tuple[str, int]:
            plan = self.make_plan(spec, job)
            return plan.run_id, self.run_plan(plan)

        return run_with_retries(once, spec.retries, self.on_err, self.retry_log)

    def run_plan(self, plan: BootstrapPlan, ranks: list[int] | None = None) -> int:
        """Start ``ranks`` (default: all) of ``plan`` as node processes and wait for rank 0."""
        ranks = list(range(plan.nodes)) if ranks is None else ranks
        self.last_run_id = plan.run_id
        temp = run_temp.own(plan.temp_root) if plan.temp_root else run_temp.make()
        (temp / "plan.json").write_text(plan.to_json())
        ensure_run_key()  # a launcher made it already; a direct caller gets one here
        env = {**node_process_env(plan), **run_temp.child_env(temp)}
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if in_main else None
        nodes: dict[int, subprocess.Popen] = {}
        try:
            for rank in ranks:
                cmd = node_command(temp / "plan.json", rank)
                if rank == 0:
                    nodes[0] = subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        bufsize=1,
                        start_new_session=True,
                    )
                else:
                    # 0600, never through a planted link (the run dir is 0700 too: run_temp.own)
                    fd = os.open(
                        temp / f"rank-{rank}.log",
                        os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                        0o600,
                    )
                    log = os.fdopen(fd, "w")  # closed by the child's exit
                    nodes[rank] = subprocess.Popen(
                        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                    log.close()
            self.started_pids = {rank: p.pid for rank, p in nodes.items()}
            if 0 not in nodes:
                raise ValueError("run_plan needs rank 0 among the ranks it starts")
            readers = [
                threading.Thread(target=_pump, args=(nodes[0].stdout, self.on_line), daemon=True),
                threading.Thread(target=_pump, args=(nodes[0].stderr, self.on_err), daemon=True),
            ]
            for reader in readers:
                reader.start()
            code = nodes[0].wait()
            for reader in readers:
                reader.join(timeout=5.0)
            # Followers exit on rank 0's release; give them a moment before we end them.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and any(p.poll() is None for p in nodes.values()):
                time.sleep(0.1)
            # Before teardown: None here means a follower did not exit when rank 0 told it to.
            self.follower_exit_codes = {r: p.poll() for r, p in nodes.items() if r != 0}
            return code
        finally:
            survivors = procs.end_run(plan.run_id)
            for proc in nodes.values():
                proc.poll()
            if in_main:
                signal.signal(signal.SIGTERM, previous)
            if survivors:
                print(f"[modal_rl.cluster] could not end PIDs {survivors}", file=sys.stderr)
            # Ray's session dirs hold MBs of logs; kept only when asked to (MODAL_RL_KEEP_LOGS).
            run_temp.remove(temp)


def _pump(stream, sink: Callable[[str], None]) -> None:
    key = os.environ.get(RUN_KEY_ENV)
    for line in stream:
        sink(redact(line.rstrip("\n"), key))


def _writer(stream) -> Callable[[str], None]:
    def write(line: str) -> None:
        stream.write(line + "\n")
        stream.flush()

    return write


def node_command(plan_path: Path, rank: int) -> list[str]:
    return [sys.executable, "-m", "modal_rl.cluster.node", "--plan", str(plan_path), "--rank", str(rank)]


def _key_entries(plan: BootstrapPlan) -> dict[str, str]:
    """The key's env entries as a dry run shows them: present, never their value."""
    return {RUN_KEY_ENV: REDACTED, **({RAY_TOKEN_ENV: REDACTED} if plan.ray_auth == "token" else {})}


def node_process_env(plan: BootstrapPlan) -> dict[str, str]:
    """Our environment (with the run key) plus the run tag, the plan's Ray auth mode and an
    import path that finds this checkout."""
    env = dict(os.environ)
    env[procs.RUN_ID_ENV] = plan.run_id
    env["RAY_AUTH_MODE"] = plan.ray_auth
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
