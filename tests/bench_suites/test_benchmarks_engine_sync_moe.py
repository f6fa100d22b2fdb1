"""The ``engine-sync`` suite's MoE row: its sparsity accounting from real router load, its
trajectory's checkpoint names and which experts its first step moves."""

from __future__ import annotations

import pytest
import torch

from benchmarks._engine_sync_moe import expert_motion, render_moe


def _state(values: dict[tuple[int, int], float]) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight": torch.full((4, 4), v, dtype=torch.bfloat16)
        for (layer, e), v in values.items()
        for p in ("gate", "up", "down")
    }


def test_expert_motion_counts_unrouted_and_unchanged_experts_per_layer():
    old = _state({(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 1.0})
    new = _state({(0, 0): 2.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 3.0})
    new["model.norm.weight"] = old["model.norm.weight"] = torch.ones(4, dtype=torch.bfloat16)  # not an expert
    load = torch.tensor([[5, 0], [0, 7]])  # layer 0: expert 1 got no token; layer 1: expert 0
    motion = expert_motion(old, new, load)
    assert motion["experts"] == 4 and motion["experts_unrouted"] == 2 and motion["experts_unchanged"] == 2
    assert motion["routed_changed_fraction"] == 1.0 and motion["unrouted_changed_fraction"] == 0.0


def test_render_names_bytes_pause_and_identity():
    moe = {
        "model": {"num_experts": 16, "num_experts_per_tok": 2, "num_hidden_layers": 4, "params_m": 15.9},
        "engine": "in process",
        "bytes_per_version": 3.1e5,
        "full_bytes_per_version": 2.1e7,
        "pause_s": 0.006,
        "full_pause_s": 0.4,
        "params_identical": True,
        "fallback_params": 0,
        "experts_unrouted_median": 6.5,
        "experts_unchanged_median": 1.5,
    }
    text = render_moe(moe)
    assert "0.31 MB delta vs 21 MB full" in text and "pause 0.006 s in place vs 0.4 s full load" in text
    assert "bit-identical to a full load: True" in text and "6.5 got no token" in text


@pytest.mark.slow  # trains the tiny MoE (the real row runs in benchmarks engine-sync)
def test_the_trajectory_has_one_tensor_per_expert_and_moves_only_routed_experts_at_first(tmp_path):
    from benchmarks._engine_sync_moe import trajectory
    from benchmarks._moe_engine import TINY, make_config_dir
    from modal_rl.weightsync.apply.moe import expert_of

    states, loads = trajectory(make_config_dir(tmp_path / "cfg", TINY), 2)
    assert len(states) == 3 and loads[0].shape == (2, 8)
    assert sum(expert_of(n) is not None for n in states[0]) == 2 * 8 * 3  # one tensor per expert
    # An expert moves in the first step if and only if the router sent it tokens (before any
    # step no expert has Adam momentum): the sparsity the row measures comes from real routing.
    for layer in range(2):
        for e in range(8):
            name = f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"
            moved = not torch.equal(states[0][name], states[1][name])
            assert moved == bool(loads[0][layer][e] > 0), (layer, e, loads[0])
