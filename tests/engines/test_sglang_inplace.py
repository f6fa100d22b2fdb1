"""SGLang's in-place custom weight loader, on a stand-in model that loads like SGLang's
(fused qkv and gate_up, a transposed copy, a tied parameter, a cast that must fall back).
SGLang itself does not run here: its scheduler's side of the call is not exercised."""

from __future__ import annotations

from modal_rl.weightsync.apply.inplace import digests
from modal_rl.weightsync.apply.sglang_inplace import inplace_loader
from tests.engines.test_engine_map import checkpoint, loaded, step


def test_buckets_are_learnt_once_then_written_in_place_bit_identical_to_a_full_load():
    v0 = checkpoint(0)
    v1, v2, v3 = step(v0, 1), step(step(v0, 1), 2), step(step(step(v0, 1), 2), 3)
    model = loaded(v0)  # as the engine loaded it from disk
    names = sorted(v1)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    assert inplace_loader(model, [(n, v1[n]) for n in first])["learnt"] == len(first)
    assert inplace_loader(model, [(n, v1[n]) for n in second])["learnt"] == len(second)
    assert digests(model) == digests(loaded(v1))
    for version in (v2, v3):
        report = inplace_loader(model, version.items())
        assert report["learnt"] == 0 and report["changed_words"] > 0 and report["fallback_params"] == 1
        assert digests(model) == digests(loaded(version))  # the cast ``scale`` was reloaded
