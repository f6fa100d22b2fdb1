"""The sandboxed variant of the CPU run, end to end: real verl 0.9.1 GRPO steps on the tiny
code task (``--tiny-task code``), whose reward is the ``modal_sandbox`` reward manager, found
by name through our ``verl.plugins`` entry point, running every response in bubblewrap
sandboxes; the rollout is verl's ``tool_agent`` loop with the sandboxed code tool loaded.
The run is the session's ``sandboxed_job`` (tests/verl_runs.py), shared with the run report's
test. An explicit ``+reward.reward_kwargs.metrics_dir`` is covered in
tests/verl_adapter/test_verl_sandbox_registration.py.

Needs the stack from ``scripts/install_verl_cpu.sh`` and bubblewrap.
"""

from __future__ import annotations

import json

import pytest

from tests._sandboxes_helpers import needs_bwrap
from tests.e2e.test_verl_cpu_run import parse_metrics
from tests.verl_runs import SANDBOXED_STEPS

pytestmark = needs_bwrap

BATCH, N = 4, 2  # tiny.WORKLOAD_SIZES: train_batch_size, rollout.n


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_grpo_steps_with_sandboxed_reward(sandboxed_job):
    # The session's sandboxed run (tests/verl_runs.py): 2 steps, every response scored in
    # bubblewrap sandboxes, none alive once the run ended.
    log = sandboxed_job.log
    assert sandboxed_job.leaked == [], sandboxed_job.leaked

    metrics = parse_metrics(log)
    assert list(metrics) == list(range(1, SANDBOXED_STEPS + 1)), log[-6000:]
    for step in metrics.values():
        for key in ("actor/pg_loss", "critic/score/mean", "num_turns/mean", "timing_s/update_weights"):
            assert key in step, key
        assert 0.0 <= float(step["critic/score/mean"]) <= 1.0  # pass/fail per sample

    # The reward manager's own counters (cumulative per reward process), in the run's parts
    # folder where the launcher pointed them.
    files = sorted((sandboxed_job.run_dir / "parts").glob("sandbox-reward-*.json"))
    assert files, f"the reward manager wrote no metrics; log tail:\n{log[-4000:]}"
    counts = [json.loads(f.read_text()) for f in files]
    assert sum(c["samples"] for c in counts) == SANDBOXED_STEPS * BATCH * N  # every rollout scored
    assert sum(c["execs"] for c in counts) >= SANDBOXED_STEPS * BATCH * N  # each ran >= 1 program
    assert sum(c["sandbox_errors"] for c in counts) == 0
    assert all(c["pool"]["failures"] == {} for c in counts), counts
    print("sandbox reward metrics:", json.dumps(counts))
