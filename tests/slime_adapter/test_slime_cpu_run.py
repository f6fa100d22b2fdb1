"""slime's own ``train.py`` / ``train_async.py``, unchanged, on this CPU: ``scripts/main_slime.sh``
end to end (real SGLang on CPU, Megatron on CPU over gloo, our sparse delta sync through slime's
disk path and our hooks, the sandboxed code reward), and the weight check that proves SGLang
samples with the trainer's weights, shown able to fail on a run whose engine is an update behind.

The slow tests need slime and Megatron-LM: ``SLIME_PATH`` / ``MEGATRON_PATH`` (checkouts), else
the public repositories (cloned at slime's pinned commits: ``MODAL_RL_SLIME_REPO`` /
``MODAL_RL_MEGATRON_REPO`` name local clones, such as the fetched mirrors on this machine);
without any of them they skip, saying what to set. The fast tests check the summary's checks
on recorded numbers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from slime_modal.cpu.summary import checks, jsonl_steps

ROOT = Path(__file__).resolve().parents[2]
MIRRORS = {
    "MODAL_RL_SLIME_REPO": Path("/work/.mirror/THUDM+slime/repo"),
    "MODAL_RL_MEGATRON_REPO": Path("/work/.mirror/NVIDIA+Megatron-LM/repo"),
}
RUN_TIMEOUT_S = 1800
# The venv scripts/main_slime.sh makes (slime's stack, tensorboard included)
SLIME_PYTHON = Path(os.environ.get("MODAL_RL_SLIME_VENV", ROOT / ".venv-slime")) / "bin" / "python"


def sources_env() -> dict[str, str]:
    """Where the install script gets slime and Megatron-LM; skips when nowhere."""
    env = {}
    for path_var, repo_var in (
        ("SLIME_PATH", "MODAL_RL_SLIME_REPO"),
        ("MEGATRON_PATH", "MODAL_RL_MEGATRON_REPO"),
    ):
        if os.environ.get(path_var) or os.environ.get(repo_var):
            continue
        if MIRRORS[repo_var].is_dir():
            env[repo_var] = str(MIRRORS[repo_var])
        elif os.environ.get("MODAL_RL_NETWORK") != "1":
            pytest.skip(
                f"no slime/Megatron-LM source: set {path_var} (a checkout) or {repo_var} (a clone), "
                "or MODAL_RL_NETWORK=1 to clone the public repositories"
            )
    return env


def main_slime(tmp_path: Path, *slime_args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "main_slime.sh"), *slime_args],
        cwd=ROOT,
        env={**os.environ, **sources_env(), "MODAL_RL_SLIME_RUN_DIR": str(run_dir), **env},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        start_new_session=True,
    )
    return proc, run_dir


def _fail(proc: subprocess.CompletedProcess, run_dir: Path) -> str:
    log = run_dir / "slime.log"
    tail = log.read_text(errors="replace")[-6000:] if log.is_file() else ""
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n--- slime.log tail ---\n{tail}"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_main_slime_run_trains_three_steps_with_delta_sync_and_sandboxed_reward(tmp_path):
    proc, run_dir = main_slime(tmp_path)
    assert proc.returncode == 0, _fail(proc, run_dir)
    out = proc.stdout
    assert "[slime_modal.cpu] CPU mode" in out
    assert out.count("[modal_rl.step] rollout") >= 3
    assert "weight checks passed" in out
    steps = jsonl_steps(run_dir / "metrics.jsonl")
    assert len(steps) >= 3
    assert sum(s.get("modal_rl/weight_sync/deltas", 0) for s in steps.values()) >= 2
    assert (run_dir / "report.html").is_file()
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    # The reward ran every sample's program in a sandbox: the reward process's numbers reached ours.
    assert all(s.get("modal_rl/sandbox/execs", 0) > 0 for s in steps.values()), steps
    # Every sample carries the version SGLang reported; train.py trains each rollout on the
    # version that made it.
    assert all(s["modal_rl/async/samples_without_versions"] == 0 for s in steps.values()), steps
    assert [s["modal_rl/async/staleness_max"] for _, s in sorted(steps.items())] == [0.0] * len(steps)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_train_async_runs_three_steps_and_the_weight_check_catches_its_stale_engine(tmp_path):
    # train_async.py samples the next rollout while the trainer updates, so each rollout comes
    # from weights one update behind: the state a skipped sync leaves. The same check that passes
    # on train.py must fail here on the gap, and pass when the gap is not checked.
    # (train.py itself syncs after every step unconditionally: slime's --update-weights-interval
    # is read only by train_async.py, so a sync cannot be skipped there without changing slime.)
    proc, run_dir = main_slime(tmp_path, MODAL_RL_SLIME_ENTRY="train_async.py")
    assert proc.returncode == 1, _fail(proc, run_dir)
    assert "weight check failed: gap" in proc.stderr, proc.stderr[-3000:]
    steps = jsonl_steps(run_dir / "metrics.jsonl")
    assert len(steps) >= 3 and proc.stdout.count("[modal_rl.step] rollout") >= 3
    # The same gap in the samples' own versions: rollout 0 comes from the first push, every
    # later one from the version before the trainer's, and no sample lacks its version.
    stale = [s["modal_rl/async/staleness_max"] for _, s in sorted(steps.items())]
    assert stale == [0.0] + [1.0] * (len(steps) - 1), steps
    assert all(s["modal_rl/async/samples_without_versions"] == 0 for s in steps.values()), steps
    assert all("modal_rl/async/engine_idle_s" in s for _, s in sorted(steps.items())[1:]), steps
    relaxed = subprocess.run(
        [str(SLIME_PYTHON), "-m", "slime_modal.cpu.summary", str(run_dir), "--max-gap", "10"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert relaxed.returncode == 0, relaxed.stdout + relaxed.stderr


def _engine_groups(marker: str) -> list[int]:
    """Process groups of SGLang engines started by our rollout manager for the run whose env
    holds ``marker`` (the run folder): each engine leads its own session (the local pool)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        pid = int(proc.name)
        if (
            b"modal_rl.engines.keyed_launch" in cmdline
            and marker.encode() in environ
            and os.getpgid(pid) == pid
        ):
            found.append(pid)
    return found


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_a_killed_sglang_engine_is_replaced_and_caught_up_and_the_run_finishes(tmp_path):
    # Our RolloutManager subclass (slime's --rollout-manager-path, patches/slime/0004) starts the
    # real SGLang engine under its supervisor; it is killed after the first step. The only proof
    # with a real SGLang and slime's own train.py that a replacement is caught up: the weight
    # check passes on the steps after it (tests/slime_adapter/test_slime_rollout_manager.py and
    # test_slime_engine_replace.py replace a keyed stand-in engine, whose weights nobody samples).
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "main_slime.sh")],
        cwd=ROOT,
        env={
            **os.environ,
            **sources_env(),
            "MODAL_RL_SLIME_RUN_DIR": str(run_dir),
            "MODAL_RL_SLIME_ENGINES": "modal:1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, killed = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if not killed and "[modal_rl.step] rollout 0" in line:
                groups = _engine_groups(str(run_dir))
                assert len(groups) == 1, f"expected one engine of this run, found {groups}"
                os.killpg(groups[0], signal.SIGKILL)
                killed.append(groups[0])
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
    out = "".join(lines)
    assert killed, f"the run never reached its first step:\n{out[-4000:]}"
    assert rc == 0, f"exit {rc}\n{out[-4000:]}"
    assert out.count("[modal_rl.step] rollout") >= 3
    assert "weight checks passed" in out
    events = [
        json.loads(x) for x in (run_dir / "parts" / "engine-events.jsonl").read_text().splitlines() if x
    ]
    kinds = [e.get("kind") or e.get("event") for e in events]
    assert any("replace" in str(k) for k in kinds), kinds


def test_the_gap_check_fails_on_a_stale_step_and_passes_when_synced():
    ours = {0: {"modal_rl/weight_sync/anchors": 1.0}, 1: {"modal_rl/weight_sync/deltas": 1.0}}
    moved = {0: -6.93, 2: -6.60}
    assert checks({0: 1e-3, 1: 1.2e-3, 2: 9e-4}, moved, ours, max_gap=0.05, min_move=0.02) == []
    failed = checks({0: 1e-3, 1: 0.31, 2: 1e-3}, moved, ours, max_gap=0.05, min_move=0.02)
    assert len(failed) == 1 and failed[0].startswith("gap:") and "step 1: 0.3100" in failed[0]


def test_engine_logprobs_that_do_not_move_and_no_deltas_fail():
    ours = {0: {"modal_rl/weight_sync/anchors": 1.0}, 1: {}}
    failed = checks({0: 1e-3, 1: 1e-3}, {0: -6.93, 1: -6.925}, ours, max_gap=0.05, min_move=0.02)
    assert [f.split(":")[0] for f in failed] == ["moved", "deltas"]
    assert checks({}, {}, {}, max_gap=0.05, min_move=0.02)[0].startswith("gap: slime logged no")


def test_metrics_jsonl_merges_rows_of_one_step(tmp_path):
    rows = [{"step": 1, "data": {"a": 1.0}}, {"step": 1, "data": {"b": 2.0}}, "not json"]
    (tmp_path / "m.jsonl").write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows))
    assert jsonl_steps(tmp_path / "m.jsonl") == {1: {"a": 1.0, "b": 2.0}}


def test_the_console_shows_phases_and_steps_once_and_hides_the_rest():
    from slime_modal.cpu.console import shown

    seen: set[str] = set()
    lines = [
        "\x1b[36m(RolloutManager pid=1)\x1b[0m [modal_rl.step] rollout 0: reward 0.008",
        "(MegatronTrainRayActor pid=2) [2026-12-06 23:40:25] timer.py:32 - Timer update_weights end (elapsed: 0.4s)",
        "(MegatronTrainRayActor pid=2) [2026-12-06 23:40:26] timer.py:32 - Timer update_weights end (elapsed: 0.7s)",
        "(pid=3) [slime_modal.cpu] CPU mode: ...",
        "(pid=4) [slime_modal.cpu] CPU mode: ...",
        '(SGLangEngine pid=5) INFO:     127.0.0.1:37880 - "POST /generate HTTP/1.1" 200 OK',
        "RuntimeError: something broke",
    ]
    assert [shown(line, seen) for line in lines] == [
        "[modal_rl.step] rollout 0: reward 0.008",
        "[slime] weights published to SGLang",
        None,
        "[slime_modal.cpu] CPU mode: ...",
        None,
        None,
        "RuntimeError: something broke",
    ]
