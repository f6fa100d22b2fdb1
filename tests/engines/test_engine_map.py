"""The engine map, learned from a model's own loader, and the staged, transactional switch.

Models here are real torch modules whose ``load_weights`` places checkpoint tensors the way
engines do: fused q/k/v and gate/up, a transposed copy, a tied parameter, a cast. The last
test builds them from vLLM's own tensor-parallel layers (``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``) for rank 0 and 1 of a 2-way split, in
this process: each rank learns its own shard's map from vLLM's weight loaders.
"""

from __future__ import annotations

import pytest
import torch

from modal_rl.weightsync.apply.engine_map import learn_map, validate
from modal_rl.weightsync.apply.inplace import StaleStageError, digests, stage, switch, undo

H, F = 16, 24  # hidden, intermediate


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return {
        "q.weight": r(H, H),
        "k.weight": r(H // 2, H),
        "v.weight": r(H // 2, H),
        "q.bias": r(H),
        "gate.weight": r(F, H),
        "up.weight": r(F, H),
        "down.weight": r(H, F),
        "emb.weight": r(32, H),
        "norm.weight": r(H),
        "scale": r(H),
    }


def step(state: dict, seed: int, fraction: float = 0.05) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.where(torch.rand(t.shape, generator=gen) < fraction, t * 1.5 + 0.01, t)
        for n, t in state.items()
    }


class Engine(torch.nn.Module):
    """Fused qkv (+ bias only for q: k/v bias rows stay pads), fused gate_up, ``down``
    stored transposed, ``head`` tied to ``emb``, ``norm`` processed after loading when
    ``process`` (doubled), ``scale`` cast to fp32."""

    def __init__(self, process: bool = False) -> None:
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.qkv, self.qkv_bias, self.gate_up = z(2 * H, H), z(2 * H), z(2 * F, H)
        self.down_t, self.emb, self.norm = (
            z(F, H),
            z(32, H),
            torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16)),
        )
        self.head = self.emb  # tied: one storage, listed once
        self.scale = torch.nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)
        self.process = process

    def load_weights(self, weights):
        rows = {
            "q.weight": (self.qkv, 0),
            "k.weight": (self.qkv, H),
            "v.weight": (self.qkv, H + H // 2),
            "gate.weight": (self.gate_up, 0),
            "up.weight": (self.gate_up, F),
        }
        for name, w in weights:
            if name in rows:
                param, at = rows[name]
                param.data[at : at + w.shape[0]].copy_(w)
            elif name == "q.bias":
                self.qkv_bias.data[:H].copy_(w)
                self.qkv_bias.data[H:].fill_(0)  # a constant, not a placement
            elif name == "down.weight":
                self.down_t.data.copy_(w.t())
            elif name == "emb.weight":
                self.emb.data.copy_(w)
            elif name == "norm.weight":
                self.norm.data.copy_(w)
            elif name == "scale":
                self.scale.data.copy_(w)
        if self.process and self.norm.dtype == torch.bfloat16:
            self.norm.data.mul_(2)  # processed after loading


def loaded(state: dict, **kw) -> Engine:
    engine = Engine(**kw)
    with torch.no_grad():
        engine.load_weights(iter(state.items()))
    return engine


def test_the_map_places_fused_transposed_and_tied_weights_and_falls_back_on_a_cast():
    v0, v1 = checkpoint(0), step(checkpoint(0), 1)
    engine = loaded(v0)
    emap = learn_map(engine, v0)
    assert set(emap.fallback) == {"scale"} and "dtype" in emap.fallback["scale"]
    assert validate(emap, v0) == []
    runs = {n: [p.is_run for p in ps] for n, ps in emap.placements.items()}
    assert runs["q.weight"] == [True] and runs["down.weight"] == [False]  # transposed: positions
    assert emap.fallback_tensors() == {"scale"}
    staged = stage(emap, v1, version=1, generation=0)
    assert set(staged.fallback) == {"scale"} and staged.changed_words > 0
    switch(emap, staged, generation=0)
    engine.load_weights(iter(staged.fallback.items()))  # what the engine does for fallbacks
    assert digests(engine) == digests(loaded(v1))  # every parameter, bit for bit, pads included


def test_a_parameter_processed_after_loading_falls_back_at_validation():
    v0 = checkpoint(0)
    engine = loaded(v0, process=True)
    emap = learn_map(engine, v0)
    assert validate(emap, v0) == ["norm"] and "processed after loading" in emap.fallback["norm"]
    assert all(p.param != "norm" for ps in emap.placements.values() for p in ps)


def test_a_switch_failing_part_way_writes_nothing_and_stale_changes_are_refused():
    v0, v1 = checkpoint(0), step(checkpoint(0), 2)
    engine = loaded(v0)
    emap = learn_map(engine, v0)
    before = digests(engine)
    staged = stage(emap, v1, version=1, generation=7)
    assert len(staged.changes) > 3
    with pytest.raises(RuntimeError, match="injected"):
        switch(emap, staged, generation=7, fail_after=3)
    assert digests(engine) == before
    with pytest.raises(StaleStageError):
        switch(emap, staged, generation=8)
    assert digests(engine) == before
    switch(emap, staged, generation=7)
    assert digests(engine) != before
    undo(emap, staged)
    assert digests(engine) == before


@pytest.mark.slow  # imports vLLM (tens of seconds)
def test_each_tensor_parallel_rank_learns_its_shard_from_vllms_loaders(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kw = dict(params_dtype=torch.bfloat16)
            self.qkv = QKVParallelLinear(H, 4, 4, 2, bias=True, prefix="qkv", **kw)
            self.gate_up = MergedColumnParallelLinear(H, [F, F], bias=False, prefix="gate_up", **kw)
            self.down = RowParallelLinear(F, H, bias=False, prefix="down", **kw)

        def load_weights(self, weights):
            shards = {
                "q": (self.qkv, "q"),
                "k": (self.qkv, "k"),
                "v": (self.qkv, "v"),
                "gate": (self.gate_up, 0),
                "up": (self.gate_up, 1),
            }
            for name, w in weights:
                layer, what = name.split(".")
                if layer == "down":
                    self.down.weight.weight_loader(self.down.weight, w)
                elif layer in shards and what in ("weight", "bias"):
                    module, shard = shards[layer]
                    param = getattr(module, what)
                    param.weight_loader(param, w, shard)

    def ckpt(seed):
        gen = torch.Generator().manual_seed(seed)
        shapes = {
            "q.weight": (16, H),
            "k.weight": (8, H),
            "v.weight": (8, H),
            "q.bias": (16,),
            "k.bias": (8,),
            "v.bias": (8,),
            "gate.weight": (F, H),
            "up.weight": (F, H),
            "down.weight": (H, F),
        }
        return {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}

    v0 = ckpt(0)
    v1 = step(v0, 3, fraction=0.1)
    for rank in range(2):
        for module in (linear, parameter):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda r=rank: r)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 2)

        def fresh(state):
            block = Block()
            with torch.no_grad():
                block.load_weights(iter(state.items()))
            return block

        engine = fresh(v0)
        assert engine.down.weight.shape == (H, F // 2)  # this rank's shard only
        emap = learn_map(engine, v0)
        # broadcast probes (the default: row ids, then column numbers, of a column-sharded
        # ``down`` too) learn what materialised index values learn
        assert _same_maps(emap, learn_map(engine, v0, probes="indices"))
        assert emap.fallback == {} and validate(emap, v0) == []
        placed = sum(p.length for ps in emap.placements.values() for p in ps)
        assert placed == sum(p.numel() for p in engine.parameters())  # every engine word, once
        switch(emap, stage(emap, v1, version=1, generation=0), generation=0)
        assert digests(engine) == digests(fresh(v1)), f"rank {rank}"


class Layered(torch.nn.Module):
    """Three ``Engine`` layers under ``model.layers.N.`` (or ``stack.N.``: parameters named
    unlike the checkpoint) and a top-level embedding, loaded by routing each checkpoint name
    to its layer's loader, as vLLM's models do."""

    def __init__(self, stack: str = "layers") -> None:
        super().__init__()
        self.model = torch.nn.Module()
        setattr(self.model, stack, torch.nn.ModuleList(Engine() for _ in range(3)))
        self.stack = getattr(self.model, stack)
        self.top = torch.nn.Parameter(torch.zeros(8, H, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "top.weight":
                self.top.data.copy_(w)
                continue
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            self.stack[int(i)].load_weights([(rest, w)])


def layered_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    out = {f"model.layers.{i}.{n}": t for i in range(3) for n, t in checkpoint(seed + i).items()}
    return out | {"top.weight": checkpoint(seed)["emb.weight"][:8]}


def _same_maps(a, b) -> bool:
    def flat(emap):
        return {
            (name, p.param, p.is_run, p.start, p.offset, p.length)
            + ((tuple(p.src.tolist()), tuple(p.dst.tolist())) if not p.is_run else ())
            for name, places in emap.placements.items()
            for p in places
        }

    return flat(a) == flat(b) and a.fallback == b.fallback


@pytest.mark.parametrize("stack", ["layers", "stack"])
def test_learning_layer_by_layer_gives_the_same_map_with_one_layers_shadow(stack):
    """Grouped learning (one layer's shadows at a time, every other parameter storage-less)
    finds exactly the map of learning everything at once; its largest shadow is one layer's
    (int32 words here), not the model's. Parameters named unlike the checkpoint (``stack``)
    are found by the extra pass."""
    state = layered_checkpoint(3)
    at_once = learn_map(Layered(stack), state, grouped=False)
    grouped = learn_map(Layered(stack), state)
    assert at_once.placements and _same_maps(grouped, at_once)
    model = Layered(stack)
    layer_params = sum(p.numel() for p in model.stack[0].parameters())
    if stack == "layers":
        assert grouped.learning["passes"] == 4  # three layers, then the rest
        assert grouped.learning["largest_group_bytes"] == 4 * layer_params  # int32: one layer
        # a bucket of one layer (SGLang's in-place loader learns bucket by bucket): one pass,
        # nothing else shadowed, no search for the parameters no tensor of it feeds
        bucket = {n: t for n, t in state.items() if n.startswith("model.layers.1.")}
        part = learn_map(Layered(stack), bucket)
        assert part.learning["passes"] == 1 and part.learning["largest_group_bytes"] == 4 * layer_params
    else:
        assert grouped.learning["passes"] == 2  # no layer's names match: the rest, then the orphans
    everything = sum(p.numel() for p in model.parameters())
    assert at_once.learning["largest_group_bytes"] == 4 * everything  # every parameter's shadow at once
    assert grouped.learning["int32_passes"] >= 1
    # the map works: a full load, then in-place changes, equals a reload of the new state
    new = step(state, 9)
    live = Layered(stack)
    live.load_weights(state.items())
    grouped.bind(live)
    assert validate(grouped, state) == []
    want = Layered(stack)
    want.load_weights(new.items())
    staged = stage(grouped, new, 1, 0)
    switch(grouped, staged, generation=0)
    assert set(grouped.fallback) == {f"model.{stack}.{i}.scale" for i in range(3)}  # the cast: reloaded
    for (n, p), (_, q) in zip(live.named_parameters(), want.named_parameters(), strict=True):
        assert n in grouped.fallback or torch.equal(p, q), n


def test_index_tensors_are_views_of_values_written_once():
    """Every pass's index tensors are views of one set of index values, written once: a
    loader that holds every tensor back until it has them all (a layer-wise reload) learns
    the map of one that copies each as it comes; a loader that writes into what it was given
    stops learning with a clear error instead of corrupting the next pass's map."""
    state = layered_checkpoint(5)
    streaming = learn_map(Layered("layers"), state)
    held = learn_map(Layered("layers"), state, lambda m, w: m.load_weights(list(w)))
    at_once = learn_map(Layered("layers"), state, lambda m, w: m.load_weights(list(w)), grouped=False)
    assert streaming.placements and _same_maps(held, streaming) and _same_maps(at_once, streaming)

    def scaling(model, weights):
        model.load_weights((n, w.mul_(1)) if n.endswith("up.weight") else (n, w) for n, w in weights)

    def shifting(model, weights):
        model.load_weights((n, w.add_(1)) if n.endswith("up.weight") else (n, w) for n, w in weights)

    assert _same_maps(learn_map(Layered("layers"), state, scaling), streaming)  # wrote, changed nothing
    with pytest.raises(RuntimeError, match="wrote into the index tensors"):
        learn_map(Layered("layers"), state, shifting)
