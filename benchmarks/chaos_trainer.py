"""Chaos scenario (c): the verl trainer killed after step 2, and the same command run again.

A real verl 0.9.1 GRPO run on this CPU (``python -m verl_modal --backend local --tiny DIR``)
with verl's own checkpointing (``trainer.save_freq``, ``trainer.default_local_dir`` on a host
path standing in for a Modal Volume, ``trainer.resume_mode=auto``). Once the step-2
checkpoint is complete (verl's ``latest_checkpointed_iteration.txt`` says 2), every process
of the run (the driver and the Ray processes it started, found by the run id in their
environment) is SIGKILLed, as a preempted container's would be; then the *same command* is
started again and must resume from step 2 and finish.

Reported: completed, steps lost (finished
steps redone), steps since the last checkpoint at the kill, recovery time (kill -> the
restarted run's first finished step), processes of either attempt left, and whether the
final actor weights equal the reference's bit for bit (vLLM sampling on CPU is not
guaranteed bit-reproducible across engine restarts, so a mismatch there is reported, not
hidden). Quick mode: 2 steps, a checkpoint after each, the kill after step 1's, and no
reference run (two verl start-ups; final weights not compared). Full mode: 5 steps, checkpoint
every 2, the kill after step 4's, and the reference (three start-ups).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"step:(\d+) - ")


class _Run:
    """``python -m verl_modal ...`` tagged with a run id; its output lines with arrival times."""

    def __init__(
        self,
        args: list[str],
        tag: str,
        log: Path,
        *,
        module: tuple[str, ...] = ("verl_modal",),
        extra_env: dict[str, str] | None = None,
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "VLLM_"))}
        env.update({"PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0", "MODAL_RL_RUN_ID": tag})
        env.update(extra_env or {})
        self.tag, self.lines = tag, []
        self.log = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *module, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))
            self.log.write(line)

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in list(self.lines) if (m := STEP_LINE.search(line))]

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_run(self.tag)
            code = self.proc.wait(30)
        self.reader.join(10)
        self.log.close()
        return code


def kill_run(tag: str) -> int:
    """SIGKILL every process of the run at once, as a preempted container; rescans, because
    Ray may fork a worker between a scan and the signal. Returns how many were killed."""
    from modal_rl.cluster import procs

    killed: set[int] = set()
    for _ in range(5):
        pids = procs.pids_of_run(tag)
        if not pids:
            break
        procs.signal_pids(pids, signal.SIGKILL)
        killed |= set(pids)
        time.sleep(0.2)
    return len(killed)


@contextlib.contextmanager
def scenario_dir(prefix: str, tags: list[str]):
    """A temp folder for one scenario that is gone afterwards, however the scenario ends: every
    process of the runs in ``tags`` is killed first (a Ray daemon still writing into it would
    make the removal fail and leave it behind)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        for tag in tags:
            kill_run(tag)
        for _ in range(5):
            shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                break
            time.sleep(1)


def checkpointed(ckpt: Path) -> int:
    path = ckpt / "latest_checkpointed_iteration.txt"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def actor_weights(ckpt: Path, step: int) -> dict:
    import torch

    out = {}
    for f in sorted((ckpt / f"global_step_{step}" / "actor").glob("model_world_size_*_rank_*.pt")):
        out.update(torch.load(f, map_location="cpu", weights_only=False))
    return out


def _equal(a: dict, b: dict) -> bool:
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return bool(a) and sorted(a) == sorted(b) and all(torch.equal(local(a[k]), local(b[k])) for k in a)


def run_scenario(quick: bool, say=print, timeout_s: float = 2400) -> dict:
    """Quick: 2 steps, a checkpoint after each, killed once step 1's is complete, no reference
    run (two verl start-ups; final weights not compared). Full: 5 steps, checkpoint every 2,
    killed after step 4's, against an undisturbed reference (three start-ups)."""
    from modal_rl.cluster import procs

    steps, save_every, kill_at, with_ref = (2, 1, 1, False) if quick else (5, 2, 4, True)
    tags: list[str] = []
    with scenario_dir("chaos-c-", tags) as tmp:

        def args(name: str) -> list[str]:
            return ["--backend", "local", "--verbose", "--tiny", str(tmp / "tiny"), "--"] + [
                f"trainer.total_training_steps={steps}",
                f"trainer.save_freq={save_every}",
                f"trainer.default_local_dir={tmp / name / 'ckpt'}",
                "trainer.resume_mode=auto",
            ]

        ref_code = None
        if with_ref:
            say(f"(c) trainer: reference verl run, {steps} steps, checkpoint every {save_every}")
            ref = _Run(args("ref"), f"chaos-c-ref-{uuid.uuid4().hex[:8]}", tmp / "ref.log")
            tags.append(ref.tag)
            ref_code = ref.wait(timeout_s)
        say(
            f"(c) trainer: verl run, {steps} steps, checkpoint every {save_every}, SIGKILL after step {kill_at}"
        )
        first = _Run(args("dis"), f"chaos-c-1-{uuid.uuid4().hex[:8]}", tmp / "first.log")
        tags.append(first.tag)
        ckpt = tmp / "dis" / "ckpt"
        deadline = time.monotonic() + timeout_s
        while checkpointed(ckpt) < kill_at and first.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if checkpointed(ckpt) < kill_at:
            first.wait(5)
            tail = " | ".join(line.strip() for _, line in first.lines[-8:])
            raise RuntimeError(f"the run never checkpointed step {kill_at}: {tail}")
        ckpt_at_kill = checkpointed(ckpt)
        # verl logs a step's metrics after saving its checkpoint: the log may lag the checkpoint.
        step_at_kill = max([s for _, s in first.steps()] + [ckpt_at_kill])
        killed_at = time.time()
        killed = kill_run(first.tag)
        first.wait(60)
        say(f"(c) trainer: killed {killed} processes at step {step_at_kill}; the same command again")
        second = _Run(args("dis"), f"chaos-c-2-{uuid.uuid4().hex[:8]}", tmp / "second.log")
        tags.append(second.tag)
        code = second.wait(timeout_s)
        deadline = time.monotonic() + 15  # a finished run's Ray daemons take a moment to exit
        while time.monotonic() < deadline and any(procs.pids_of_run(tag) for tag in tags):
            time.sleep(0.5)
        leaked = sorted({pid for tag in tags for pid in procs.pids_of_run(tag)})
        after = second.steps()
        resumed_from = min((s for _, s in after), default=None)
        match = None
        if code == 0 and ref_code == 0:
            match = _equal(actor_weights(tmp / "ref" / "ckpt", steps), actor_weights(ckpt, steps))
    say(f"(c) trainer: restarted run exit {code}, steps {[s for _, s in after]}")
    resumed_step = None if resumed_from is None else resumed_from - 1
    return {
        "name": "c_trainer_restart",
        "completed": code == 0
        and ref_code in (None, 0)
        and resumed_from is not None
        and max(s for _, s in after) == steps,
        "steps_lost": None if resumed_step is None else step_at_kill - resumed_step,
        "steps_since_checkpoint": step_at_kill - ckpt_at_kill,
        "wrong_version_samples": None,
        "recovery_s": round(after[0][0] - killed_at, 3) if after else None,
        "engine_cold_start_s": None,
        "anchor_transfer_s": None,
        "leaked_processes": len(leaked),
        "leaked_sandboxes": None,
        "final_weights_match": match,
        "details": {
            "steps": steps,
            "save_every": save_every,
            "step_at_kill": step_at_kill,
            "checkpoint_at_kill": ckpt_at_kill,
            "restarted_steps": [s for _, s in after],
            "exit_codes": {"reference": ref_code, "restarted": code},
            "leaked_pids": leaked,
            "final_weights_rule": "bit-equal to an undisturbed reference"
            if with_ref
            else "quick: no reference run, final weights not compared (full mode)",
            "note": "trainer_mode sync (hybrid engine); version numbering across the restart is "
            "issue 13 item 1 (epochs) and is not checked here",
        },
    }
