"""Changes in checkpoint coordinates (``moe.checkpoint_changes``) staged through an engine map
(``moe.stage_changes``) on the test engine of ``test_engine_map``: fused, transposed (position
placements, not runs), tied and cast parameters, from two dim-0-sharded publishers. Fast: no
vLLM here (``test_engine_map_moe.py`` runs vLLM's MoE model)."""

from __future__ import annotations

import torch

from modal_rl.weightsync.apply.engine_map import learn_map
from modal_rl.weightsync.apply.inplace import digests, switch
from modal_rl.weightsync.apply.moe import checkpoint_changes, expert_of, stage_changes
from tests.engines.test_engine_map import checkpoint, loaded, step


def test_sharded_changes_land_like_a_full_load_through_runs_and_positions():
    v0, v1 = checkpoint(0), step(checkpoint(0), 5)
    engine = loaded(v0)
    emap = learn_map(engine, v0)
    assert not all(p.is_run for p in emap.placements["down.weight"])  # transposed: positions
    parts = [checkpoint_changes(v0, v1, rows=(r, 3)) for r in range(3)]  # 3 trainer ranks
    whole = {n: pos for n, pos, _ in checkpoint_changes(v0, v1)}
    for name, pos in whole.items():  # the shards' positions are the whole tensor's, split
        got = torch.cat([p for part in parts for n, p, _ in part if n == name])
        assert torch.equal(torch.sort(got).values, pos)
    staged = stage_changes(emap, [c for part in parts for c in part], version=1, generation=0)
    assert set(staged.fallback) == {"scale"}  # a cast: the caller reloads the full tensor
    switch(emap, staged, generation=0)
    engine.load_weights(iter({"scale": v1["scale"]}.items()))
    assert digests(engine) == digests(loaded(v1))


def test_tensors_the_map_does_not_place_are_skipped_and_expert_names_parse():
    v0 = checkpoint(0)
    emap = learn_map(loaded(v0), v0)
    foreign = [
        (
            "model.layers.0.mlp.experts.9.up_proj.weight",
            torch.tensor([0]),
            torch.tensor([1], dtype=torch.int16),
        )
    ]
    staged = stage_changes(emap, foreign, version=1, generation=0)
    assert staged.changes == [] and staged.changed_words == 0
    assert expert_of("model.layers.3.mlp.experts.12.down_proj.weight") == ("model.layers.3.mlp.experts", 12)
    assert expert_of("model.layers.3.block_sparse_moe.experts.0.w1.weight") == (
        "model.layers.3.block_sparse_moe.experts",
        0,
    )
    assert expert_of("model.layers.3.mlp.shared_expert.up_proj.weight") is None
