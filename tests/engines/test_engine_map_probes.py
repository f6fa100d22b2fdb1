"""Broadcast probes (row ids, then column numbers, each a stride-0 view) learn exactly the map
materialised index values learn, on the models of ``test_engine_map`` (fused, transposed,
tied, cast, padded; layer by layer, and with parameters named unlike the checkpoint) and a
model of 0-D, 1-D, 3-D and empty tensors; a loader that refuses a broadcast probe gets the
materialised one; a loader that places differently in its two passes, or changes the values,
sends the parameter to ``fallback``; without numba the same. vLLM's tensor-parallel layers
and MoE model are compared in ``test_engine_map.py`` / ``test_engine_map_moe.py``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from modal_rl.weightsync.apply import engine_map_combine, engine_map_runs
from modal_rl.weightsync.apply.engine_map import learn_map, validate
from tests.engines.test_engine_map import Layered, _same_maps, checkpoint, layered_checkpoint, loaded


class Shapes(torch.nn.Module):
    """A 0-D scale, a 1-D bias into the head of a padded parameter, a 3-D expert stack
    loaded as is and one loaded with its last two dimensions swapped, an empty tensor."""

    def __init__(self) -> None:
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.scale, self.bias, self.experts, self.swapped, self.empty = (
            z(),
            z(12),
            z(4, 8, 16),
            z(4, 16, 8),
            z(0, 4),
        )

    def load_weights(self, weights):
        for name, w in weights:
            if name == "bias":
                self.bias.data[:8].copy_(w)
                self.bias.data[8:].fill_(0)  # a pad
            elif name == "swapped":
                self.swapped.data.copy_(w.transpose(1, 2))
            else:
                getattr(self, name).data.copy_(w)


def shapes_checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    shapes = {"scale": (), "bias": (8,), "experts": (4, 8, 16), "swapped": (4, 8, 16), "empty": (0, 4)}
    return {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}


MODELS = {
    "fused-transposed-tied-cast": (lambda: loaded(checkpoint(0)), lambda: checkpoint(0)),
    "layered": (lambda: Layered("layers"), lambda: layered_checkpoint(3)),
    "named-otherwise": (lambda: Layered("stack"), lambda: layered_checkpoint(3)),
    "shapes": (Shapes, shapes_checkpoint),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_broadcast_probes_learn_the_materialised_map_with_a_fraction_of_its_probe_values(model):
    make, state = MODELS[model]
    materialised = learn_map(make(), state(), probes="indices")
    broadcast = learn_map(make(), state())
    assert materialised.placements and _same_maps(broadcast, materialised)
    assert broadcast.learning["materialised_groups"] == 0
    assert materialised.learning["materialised_groups"] == materialised.learning["passes"]
    assert broadcast.learning["index_bytes"] * 4 < materialised.learning["index_bytes"]
    # the transposed copies (``down_t``, ``swapped``) have no row runs: kept whole
    assert broadcast.learning["dense_rows_params"] == {"shapes": 1, "fused-transposed-tied-cast": 1}.get(
        model, 3
    )
    assert {"rows_load_s", "compress_s", "cols_load_s", "combine_s"} <= set(broadcast.timings)


def test_the_shapes_model_is_placed_as_its_loader_places_it():
    state = shapes_checkpoint()
    engine = Shapes()
    engine.load_weights(state.items())
    emap = learn_map(engine, state)
    assert emap.fallback == {} and validate(emap, state) == []
    (bias,) = emap.placements["bias"]
    assert (bias.param, bias.start, bias.offset, bias.length) == ("bias", 0, 0, 8)  # the pad: no placement
    (swapped,) = emap.placements["swapped"]
    assert not swapped.is_run and swapped.length == 4 * 8 * 16
    assert emap.placements.get("empty", []) == []


def test_a_loader_that_refuses_broadcast_probes_gets_materialised_ones_group_by_group():
    state = layered_checkpoint(5)
    want = learn_map(Layered("layers"), state, probes="indices")

    def flat_view(model, weights):  # ``view(-1)`` needs contiguous memory: a broadcast probe raises
        model.load_weights((n, t.view(-1).view(t.shape)) for n, t in weights)

    def flat_view_in_layer_1(model, weights):
        model.load_weights((n, t.view(-1).view(t.shape) if ".1." in n else t) for n, t in weights)

    def contiguous(model, weights):  # a copy: the values are kept, only memory is spent
        model.load_weights((n, t.contiguous()) for n, t in weights)

    for load, materialised in ((flat_view, 4), (flat_view_in_layer_1, 1), (contiguous, 0)):
        emap = learn_map(Layered("layers"), state, load)
        assert _same_maps(emap, want) and emap.learning["materialised_groups"] == materialised, load


def _second_pass_differs(skip_rows: bool = False, skip_cols: bool = False, swap_cols: bool = False):
    """A loader of ``Layered`` whose two probe passes of layer 1 differ: ``q`` left out of
    the row or the column pass, or ``k`` and ``v`` (one shape) swapped in the column pass."""
    seen = Counter()
    swap = {
        "model.layers.1.k.weight": "model.layers.1.v.weight",
        "model.layers.1.v.weight": "model.layers.1.k.weight",
    }

    def load(model, weights):
        def each():
            held = dict(weights)
            for n, t in held.items():
                seen[n] += 1
                if n == "model.layers.1.q.weight" and (
                    (skip_rows and seen[n] == 1) or (skip_cols and seen[n] == 2)
                ):
                    continue
                yield n, (held[swap[n]] if swap_cols and n in swap and seen[n] == 2 else t)

        model.load_weights(each())

    return load


def _places(emap, name: str) -> list[tuple]:
    return [
        (p.param, p.start, p.offset, p.length) + (() if p.is_run else (p.src.tolist(), p.dst.tolist()))
        for p in emap.placements.get(name, [])
    ]


@pytest.mark.parametrize("differs", ["skip_rows", "skip_cols", "swap_cols"])
def test_a_parameter_its_loader_places_differently_in_the_two_passes_falls_back(differs):
    """Layer 1's fused ``qkv`` is placed differently by the two passes (an element placed by
    one pass only, or from another tensor of the same shape: columns are numbered per
    tensor), so it falls back, and with it ``q``, ``k`` and ``v``'s placements there; every
    other parameter is learnt as usual."""
    state = layered_checkpoint(6)
    emap = learn_map(Layered("layers"), state, _second_pass_differs(**{differs: True}))
    want = learn_map(Layered("layers"), state, probes="indices")
    assert "its two probe passes place element" in emap.fallback.pop("model.layers.1.qkv")
    assert emap.fallback == want.fallback
    for name in ("q.weight", "k.weight", "v.weight"):
        assert "model.layers.1." + name not in emap.placements
        assert _places(emap, "model.layers.0." + name) == _places(want, "model.layers.0." + name)
    qkv = ("model.layers.1.q.", "model.layers.1.k.", "model.layers.1.v.")
    kept = [n for n in want.placements if not n.startswith(qkv)]
    assert kept and all(_places(emap, n) == _places(want, n) for n in kept)


def test_values_changed_by_the_loader_fall_back_with_either_probe():
    state = layered_checkpoint(7)

    def plus_one(model, weights):
        model.load_weights((n, t + 1 if n.endswith("up.weight") else t) for n, t in weights)

    broadcast = learn_map(Layered("layers"), state, plus_one)
    materialised = learn_map(Layered("layers"), state, plus_one, probes="indices")
    gate_up = {f"model.layers.{i}.gate_up" for i in range(3)}
    assert gate_up <= set(broadcast.fallback) and set(broadcast.fallback) == set(materialised.fallback)
    assert all("changed by the loader" in broadcast.fallback[p] for p in gate_up)


def test_without_numba_the_same_maps_and_the_same_reasons(monkeypatch):
    def learn_all():
        return [learn_map(make(), state()) for make, state in MODELS.values()] + [
            learn_map(Layered("layers"), layered_checkpoint(8), _second_pass_differs(**{differs: True}))
            for differs in ("skip_rows", "skip_cols", "swap_cols")
        ]

    with_numba = learn_all()
    for module, kernel in (
        (engine_map_combine, "ROW_RUNS"),
        (engine_map_combine, "COMBINE"),
        (engine_map_combine, "COMBINED_RUNS"),
        (engine_map_runs, "RUN_BREAKS"),
    ):
        monkeypatch.setattr(getattr(module, kernel), "get", lambda: None)
    without = learn_all()
    assert all("model.layers.1.qkv" in emap.fallback for emap in with_numba[-3:])
    for a, b in zip(with_numba, without, strict=True):
        assert a.placements and _same_maps(a, b)  # the fallback reasons too
