"""Chaos scenario (d): a local cluster follower SIGKILLed mid-job, with ``--retries 1``.

A real 2-node local cluster (the bootstrap Modal containers run) runs
``benchmarks.chaos_cluster_job`` - a checkpointing training loop whose steps run on rank 1 -
through the Ray Job API. Once the job has passed a checkpoint and made more steps, rank 1's
whole node (its node process, ``ray start`` and raylet: one process group) is SIGKILLed, as a
preempted container would be. Rank 0 reports the loss, the backend starts a fresh cluster,
the same job resumes from its checkpoint and finishes.

Measured against the undisturbed result of the same steps (computed in this process: the
job's step function is deterministic, so that is the reference run's final state, bit for
bit): completed, steps lost (steps done before the kill and done again), steps since the
last checkpoint at the kill, recovery time (kill -> the resumed job's first new step), and
processes of either attempt left after the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path


def reference_digest(steps: int) -> str:
    import numpy as np

    from benchmarks.chaos_cluster_job import DIM, step_weights

    weights = np.zeros(DIM)
    for step in range(1, steps + 1):
        weights = step_weights(weights, step)
    return hashlib.sha256(weights.tobytes()).hexdigest()


class _Lines:
    def __init__(self):
        self.items: list[tuple[float, str]] = []

    def __call__(self, line: str) -> None:
        self.items.append((time.time(), line))


def progress(ckpt: Path) -> list[tuple[str, int, float]]:
    """``(kind, step, unix time)`` from the job's progress log ("resumed" or "step")."""
    path = ckpt / "progress.log"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 3:
            out.append((parts[0], int(parts[1]), float(parts[2])))
    return out


def run_scenario(quick: bool, say=print, join_s: float = 300.0) -> dict:
    from modal_rl.cluster import procs
    from modal_rl.cluster.backend import JobRequest
    from modal_rl.cluster.backend_local import LocalBackend
    from modal_rl.cluster.spec import ClusterSpec

    steps, save_every, kill_after = (8, 3, 5) if quick else (16, 5, 12)
    out, err = _Lines(), _Lines()  # the job's log (Ray's tail) and rank 0's reports
    backend = LocalBackend(on_line=out, on_err=err)
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="chaos-d-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        job = JobRequest(
            [sys.executable, "-m", "benchmarks.chaos_cluster_job", "--ckpt", str(ckpt)]
            + ["--steps", str(steps), "--save-every", str(save_every), "--step-s", "0.5", "--nodes", "2"]
        )
        spec = ClusterSpec(nodes=2, retries=1, join_timeout_s=join_s)
        say(f"(d) cluster: 2 local nodes, --retries 1, {steps} steps, checkpoint every {save_every}")
        runner = threading.Thread(target=lambda: result.update(code=backend.run(spec, job)), daemon=True)
        started = time.monotonic()
        runner.start()
        deadline = started + join_s + 300
        done: list[int] = []
        while runner.is_alive() and time.monotonic() < deadline:
            done = [step for kind, step, _ in progress(ckpt) if kind == "step"]
            if done and max(done) >= kill_after:
                break
            time.sleep(0.05)
        if not done or max(done) < kill_after:
            raise RuntimeError("the job never reached the kill point; rank 0 said:\n" + _tail(err))
        step_at_kill = max(done)
        first_run_id = backend.last_run_id
        say(f"(d) cluster: SIGKILL rank 1's node after step {step_at_kill}")
        killed_at = time.time()
        os.killpg(backend.started_pids[1], signal.SIGKILL)
        runner.join(timeout=join_s + 300)
        if runner.is_alive():
            raise RuntimeError("the retried run did not finish; rank 0 said:\n" + _tail(err))
        final = (ckpt / "final.json").read_text() if (ckpt / "final.json").exists() else None
        log = progress(ckpt)
    resumed = [(t, step) for kind, step, t in log if kind == "resumed" and t > killed_at]
    new_steps = [t for kind, _, t in log if kind == "step" and t > killed_at]
    lost_seen = next((t for t, line in err.items if "rank 1 lost" in line), None)
    run_ids = [a.run_id for a in backend.retry_log.attempts] or [first_run_id]
    leaked = sorted({pid for run_id in run_ids for pid in procs.pids_of_run(run_id)})
    digest = json.loads(final)["sha256"] if final else None
    resumed_step = resumed[0][1] if resumed else None
    if resumed_step is not None:  # steps the first attempt finished after our look, before dying
        step_at_kill = max(
            [step_at_kill] + [step for kind, step, t in log if kind == "step" and t <= killed_at]
        )
    ckpt_step = max([0] + [s for s in range(save_every, step_at_kill + 1, save_every)])  # last written
    say(f"(d) cluster: exit {result.get('code')}, {len(backend.retry_log.attempts)} attempts")
    return {
        "name": "d_cluster_follower_kill",
        "completed": result.get("code") == 0 and digest is not None,
        "steps_lost": None if resumed_step is None else step_at_kill - resumed_step,
        "steps_since_checkpoint": step_at_kill - ckpt_step,
        "wrong_version_samples": None,
        "recovery_s": round(new_steps[0] - killed_at, 3) if new_steps else None,
        "engine_cold_start_s": None,
        "anchor_transfer_s": None,
        "leaked_processes": len(leaked),
        "leaked_sandboxes": None,
        "final_weights_match": digest == reference_digest(steps) if digest else False,
        "details": {
            "exit_code": result.get("code"),
            "attempts": [
                {"exit_code": a.exit_code, "s": round(a.ended - a.started, 3)}
                for a in backend.retry_log.attempts
            ],
            "steps": steps,
            "save_every": save_every,
            "step_at_kill": step_at_kill,
            "checkpoint_step_at_kill": ckpt_step,
            "resumed_from": resumed_step,
            "loss_reported_after_s": None if lost_seen is None else round(lost_seen - killed_at, 3),
            "reference": "the same deterministic steps computed in-process",
            **({} if result.get("code") == 0 else {"rank0_tail": _tail(err, 25)}),
        },
    }


def _tail(lines: _Lines, n: int = 40) -> str:
    return "\n".join(line for _, line in lines.items[-n:])
