"""The sandboxed variant of the CPU run, end to end: one real verl 0.9.1 GRPO step on the tiny
code task (``--tiny-task code``), whose reward is the ``modal_sandbox`` reward manager, found
by name through our ``verl.plugins`` entry point, running every response in bubblewrap
sandboxes; the rollout is verl's ``tool_agent`` loop with the sandboxed code tool loaded.

Needs the stack from ``scripts/install_verl_cpu.sh`` and bubblewrap.
"""

from __future__ import annotations

import json
import os

import pytest
from _sandboxes_helpers import needs_bwrap

from modal_rl.sandboxes import registry
from tests.test_verl_cpu_run import parse_metrics, run_launcher
from tests.verl_plugin_helpers import plugin_env

pytestmark = needs_bwrap

BATCH, N = 4, 2  # tiny.WORKLOAD_SIZES: train_batch_size, rollout.n


def leaked(registry_dir) -> list[dict]:
    """Registered sandboxes of the run whose process is still alive (same PID and start time)."""
    return [
        e
        for e in registry.entries(registry_dir)
        if e.get("starttime") is not None and registry.proc_starttime(int(e["pid"])) == e["starttime"]
    ]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_one_grpo_step_with_sandboxed_reward(tmp_path):
    sandboxes, metrics_dir = tmp_path / "sandbox-registry", tmp_path / "sandbox-metrics"
    env = plugin_env(tmp_path / "plugins")  # this checkout's entry points, as `pip install -e .` writes
    extra_env = {
        "PYTHONPATH": env["PYTHONPATH"],
        "MODAL_RL_SANDBOX_REGISTRY": str(sandboxes),
        "MODAL_RL_RUN_ID": f"verl-sandbox-test-{os.getpid()}",
    }
    try:
        code, log = run_launcher(
            [
                "--backend",
                "local",
                "--tiny",
                str(tmp_path / "tiny"),
                "--tiny-task",
                "code",
                "--",
                "trainer.total_training_steps=1",
                f"+reward.reward_kwargs.metrics_dir={metrics_dir}",
            ],
            timeout=1400,
            extra_env=extra_env,
        )
        assert code == 0, log[-6000:]
        still_alive = leaked(sandboxes)
    finally:
        registry.sweep(sandboxes, {"run": extra_env["MODAL_RL_RUN_ID"]})  # whatever happened above
    assert still_alive == [], still_alive

    step = parse_metrics(log).get(1)
    assert step is not None, log[-6000:]
    for key in ("actor/pg_loss", "critic/score/mean", "num_turns/mean", "timing_s/update_weights"):
        assert key in step, key
    assert 0.0 <= float(step["critic/score/mean"]) <= 1.0  # pass/fail per sample

    files = sorted(metrics_dir.glob("sandbox-reward-*.json"))
    assert files, f"the reward manager wrote no metrics; log tail:\n{log[-4000:]}"
    counts = [json.loads(f.read_text()) for f in files]
    assert sum(c["samples"] for c in counts) == BATCH * N  # every rollout was scored by it
    assert sum(c["execs"] for c in counts) >= BATCH * N  # each ran >= 1 program in a sandbox
    assert sum(c["sandbox_errors"] for c in counts) == 0
    assert all(c["pool"]["failures"] == {} for c in counts), counts
    print("sandbox reward metrics:", json.dumps(counts))
