"""Rank 0: start the Ray head, wait for every rank, run the job, watch the followers.

Order, and why:
1. the control server first, so followers can report even if the head never comes up;
2. ``ray start --head --block`` as a child (node IP pinned);
3. wait until each rank's node is ALIVE with its GPUs, identified by the per-rank custom
   resource ``modal_rl_rank_<i>`` (so a timeout names the missing ranks), polling the
   dashboard's state API, which the Job API needs anyway;
4. optionally a collective check job (all-reduce on every node, with a timeout);
5. the entrypoint through the Ray Job API; logs tailed to stdout as they come; the job's
   driver exit code becomes ours; a lost follower stops the job and exits 70;
6. release the followers (they stop their nodes and exit), stop the head node.

Auth: with ``RAY_AUTH_MODE=token`` in this process's env (the bootstrap sets it, with the
run key as ``RAY_AUTH_TOKEN``), Ray's own clients used here (``JobSubmissionClient``
including its log-tail websocket, ``ray.util.state.list_nodes``) send the token themselves.
Everything rank 0 prints (its messages, the job's logs, Ray's last lines) passes ``redact``.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
import threading
import time
from typing import TextIO

from modal_rl.cluster import plan as P
from modal_rl.cluster.control import ControlServer
from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.raynode import RayNode, ray_start_argv
from modal_rl.run_key import redact

AGENT_WAIT_S = 60.0  # how long a job submission waits for the head's dashboard agent


def _say(msg: str) -> None:
    print(redact(f"[modal_rl.cluster rank 0] {msg}"), file=sys.stderr, flush=True)


class BootstrapError(RuntimeError):
    """Bring-up failed; ``exit_code`` is one of the plan's EXIT_* codes."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Head:
    def __init__(self, plan: BootstrapPlan, node_env: dict[str, str], out: TextIO):
        self.plan = plan
        self.node_env = node_env
        self.out = out
        self.control = ControlServer(plan.nodes, plan.lost_after_s)
        self.node: RayNode | None = None
        self.client = None
        self.job_id: str | None = None
        self.started = time.monotonic()
        self.head_started = threading.Event()

    def _head_line(self, line: str) -> None:
        # `ray start` prints this once GCS and raylet are up, the point where a bare
        # `ray start --head` returns and a user would start the workers.
        if "Ray runtime started" in line:
            self.head_started.set()

    # ---- bring-up -------------------------------------------------------------------
    def _check_head(self) -> None:
        if self.node is not None and self.node.poll() is not None:
            tail = "\n".join(f"    [rank 0] {line}" for line in self.node.lines)
            raise BootstrapError(
                f"the Ray head exited with code {self.node.poll()} during bring-up; last lines:\n{tail}",
                P.EXIT_HEAD_FAILED,
            )

    def _check_followers(self) -> None:
        lost = self.control.failures()
        if lost:
            raise BootstrapError(self._lost_message(lost), P.EXIT_FOLLOWER_LOST)

    def _lost_message(self, lost) -> str:
        parts = [f"rank {s.rank} lost: {s.lost}; last lines from rank {s.rank}:\n{s.tail()}" for s in lost]
        return "\n".join(parts)

    def _alive_ranks(self) -> dict[int, float]:
        """rank -> GPUs of that rank's ALIVE node, from the dashboard's state API."""
        from ray.util.state import list_nodes

        nodes = list_nodes(
            address=self.plan.dashboard_url(), detail=True, timeout=5, raise_on_missing_output=False
        )
        ranks: dict[int, float] = {}
        for node in nodes:
            if node.state != "ALIVE":
                continue
            for key in node.resources_total:
                match = re.fullmatch(r"modal_rl_rank_(\d+)", key)
                if match:
                    ranks[int(match.group(1))] = node.resources_total.get("GPU", 0.0)
        return ranks

    async def wait_for_nodes(self) -> None:
        """Wait for the head, then for every rank; the join clock starts once the head is up.

        Followers cannot join before the head's GCS and dashboard answer, so the head's own
        start-up (slow on a busy machine) is bounded separately, by ``head_timeout_s``.
        """
        plan = self.plan
        deadline = time.monotonic() + plan.head_timeout_s
        head_up = False
        polls = 0
        ranks: dict[int, float] = {}
        while True:
            self._check_head()
            self._check_followers()
            try:
                # Before `ray start` reports the head up, poll rarely: each poll costs the
                # starting dashboard CPU, and the output line is the faster signal anyway.
                polls += 1
                early = not (head_up or self.head_started.is_set())
                ranks = await asyncio.to_thread(self._alive_ranks) if not early or polls % 8 == 0 else {}
            except Exception:  # dashboard not up yet: keep polling until the deadline
                ranks = {}
            if not head_up and (0 in ranks or self.head_started.is_set()):
                head_up = True
                deadline = time.monotonic() + plan.join_timeout_s
                await self.control.announce_head_up()
                _say(f"head node up after {time.monotonic() - self.started:.1f} s")
            ready = [r for r, gpus in ranks.items() if gpus >= plan.gpus_per_node]
            if len(ready) == plan.nodes:
                return
            if time.monotonic() > deadline:
                raise BootstrapError(self._join_timeout_message(ranks, head_up), P.EXIT_JOIN_TIMEOUT)
            await asyncio.sleep(0.25)

    def _join_timeout_message(self, ranks: dict[int, float], head_up: bool) -> str:
        plan = self.plan
        missing = [r for r in range(plan.nodes) if ranks.get(r, -1) < plan.gpus_per_node]
        if head_up:
            lines = [f"ranks {missing} did not join within {plan.join_timeout_s:g} s of the head coming up:"]
        else:
            lines = [f"the head did not come up within {plan.head_timeout_s:g} s; ranks {missing} missing:"]
        for r in missing:
            if r in ranks:
                why = f"Ray node up with {ranks[r]:g} GPUs, expected {plan.gpus_per_node}"
            elif r == 0:
                why = "the head node did not register (dashboard unreachable?)"
            else:
                state = self.control.followers[r]
                why = (
                    "no contact from its node process"
                    if state.connected_at is None
                    else f"node process up but its Ray node never registered; last lines:\n{state.tail()}"
                )
            lines.append(f"  rank {r}: {why}")
        return "\n".join(lines)

    # ---- jobs -----------------------------------------------------------------------
    def _job_runtime_env(self) -> dict:
        env = dict(self.plan.runtime_env)
        env["env_vars"] = {**self.node_env, **env.get("env_vars", {})}
        return env

    async def _submit(self, client, entrypoint: str) -> str:
        """Submit the job. Ray answers "No available agent to submit job" until the head's
        dashboard agent has registered, which can lag the node's own start by seconds on a
        busy host: that answer is retried for up to ``AGENT_WAIT_S``, any other raised."""
        deadline = time.monotonic() + AGENT_WAIT_S
        while True:
            try:
                return await asyncio.to_thread(
                    client.submit_job, entrypoint=entrypoint, runtime_env=self._job_runtime_env()
                )
            except RuntimeError as exc:
                if "No available agent" not in str(exc) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.5)

    async def run_job(self, argv: list[str], timeout_s: float, tail_logs: bool = True) -> int:
        """Submit ``argv`` as a Ray job, stream its logs, return the driver's exit code."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        if self.client is None:
            self.client = await asyncio.to_thread(JobSubmissionClient, self.plan.dashboard_url())
        client = self.client
        entrypoint = shlex.join(argv)
        self.job_id = await self._submit(client, entrypoint)
        _say(f"submitted job {self.job_id}: {entrypoint}")
        tail = asyncio.create_task(self._tail(self.job_id)) if tail_logs else None
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    self._check_head()  # the head's Ray node dying ends the job with it
                except BootstrapError as exc:
                    _say(str(exc).replace("during bring-up", "during the job"))
                    return P.EXIT_HEAD_FAILED
                info = await asyncio.to_thread(client.get_job_info, self.job_id)
                if info.status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                    break
                lost = self.control.failures()
                if lost:
                    _say(self._lost_message(lost))
                    await asyncio.to_thread(client.stop_job, self.job_id)
                    return P.EXIT_FOLLOWER_LOST
                if time.monotonic() > deadline:
                    _say(f"job {self.job_id} ran past its timeout of {timeout_s:g} s; stopping it")
                    await asyncio.to_thread(client.stop_job, self.job_id)
                    return P.EXIT_JOB_TIMEOUT
                await asyncio.sleep(0.25)
            if tail is not None:
                await asyncio.wait_for(tail, 10.0)
        except TimeoutError:
            pass
        finally:
            if tail is not None and not tail.done():
                tail.cancel()
        if info.status != JobStatus.SUCCEEDED and await self._lost_during_job():
            return P.EXIT_FOLLOWER_LOST
        return _exit_code(info)

    async def _lost_during_job(self, grace_s: float = 2.0) -> bool:
        """A job that failed because a node died can end before rank 0 hears of the death
        (its driver sees the dead actors first); then the loss, not the job, is the cause,
        which is what decides whether the run is retried."""
        deadline = time.monotonic() + (grace_s if self.plan.nodes > 1 else 0.0)
        while True:
            lost = self.control.failures()
            if lost:
                _say(self._lost_message(lost))
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    async def _tail(self, job_id: str) -> None:
        async for chunk in self.client.tail_job_logs(job_id):
            self.out.write(redact(chunk))
            self.out.flush()

    # ---- whole run ------------------------------------------------------------------
    async def run(self) -> int:
        plan = self.plan
        await self.control.start(plan.head_address(), plan.control_port)
        started = self.started = time.monotonic()
        self.node = RayNode(ray_start_argv(plan, 0), on_line=self._head_line)
        # Import the Ray client modules while the head starts, not after it is up.
        threading.Thread(target=_import_ray_clients, daemon=True).start()
        try:
            try:
                await self.wait_for_nodes()
            except BootstrapError as exc:
                _say(str(exc))
                return exc.exit_code
            _say(f"all {plan.nodes} nodes joined in {time.monotonic() - started:.1f} s")
            await self.control.broadcast({"joined": True})
            if plan.collective_check:
                code = await self.run_job(
                    [sys.executable, "-m", "modal_rl.cluster.collective", "--nodes", str(plan.nodes)]
                    + ["--timeout", str(plan.collective_timeout_s)],
                    timeout_s=plan.collective_timeout_s,
                    tail_logs=False,
                )
                if code == P.EXIT_FOLLOWER_LOST:  # a lost node, not a broken collective
                    return code
                if code != 0:
                    _say(f"collective check failed (exit {code}); not starting the job")
                    return P.EXIT_COLLECTIVE_FAILED
                _say("collective check passed")
            return await self.run_job(plan.entrypoint, timeout_s=plan.job_timeout_s)
        finally:
            await self.control.release(0)
            self.node.stop()


def _import_ray_clients() -> None:
    import ray.job_submission  # noqa: F401
    import ray.util.state  # noqa: F401


def _exit_code(info) -> int:
    from ray.job_submission import JobStatus

    if info.status == JobStatus.SUCCEEDED:
        return 0
    if info.driver_exit_code is not None:
        return int(info.driver_exit_code) or 1
    match = re.search(r"exit code (\d+)", info.message or "")
    if match:
        return int(match.group(1)) or 1
    _say(f"job ended {info.status}: {info.message}")
    return 1
