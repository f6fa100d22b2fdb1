"""Where the publisher keeps its one snapshot (``snapshot_on``) and its audit of it.

A device snapshot (beside the trainer's tensors, diffed by torch) must publish exactly what a
host snapshot publishes, keep one copy written in place, and never stage the state on the
host; on this CPU machine "beside" is the CPU, so the same torch code runs that a GPU runs.
The audit sums the snapshot in full: damage there (where no delta writes) makes receivers
refuse deltas, and the audit turns the next version into an anchor that heals them.
"""

from __future__ import annotations

import pytest
import torch

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.codec import differ as differ_module
from modal_rl.weightsync.codec.chunk_sums import held_sums
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from tests.memory_transport import Hub, MemorySink, MemorySource
from tests.weightsync_helpers import TEST_KEY, clone_state, model_state, perturb, same_state

CONFIG = CodecConfig(threads=1, chunk_elems=1 << 12)
EPOCH = 0x5A5A


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def versions(count: int) -> list[dict[str, torch.Tensor]]:
    """An anchor's state and ``count - 1`` sparse steps after it, with float32 and int64 tensors
    beside the bf16 ones (one word size each)."""
    first = model_state(0)
    gen = torch.Generator().manual_seed(1)
    first["norm.f32"] = torch.randn(3000, generator=gen)
    first["step.i64"] = torch.randint(0, 1 << 40, (500,), generator=gen)
    out = [first]
    for v in range(1, count):
        out.append(perturb(out[-1], 0.02, seed=v))
    return out


def frames_of(hub: Hub) -> list[list[bytes]]:
    return [list(kept.records) for kept, _done in hub.frames]


def test_a_device_snapshot_publishes_what_a_host_one_does_with_one_copy_written_in_place(monkeypatch):
    torch_diffs = []
    real_diff = differ_module.TorchDiffer.diff
    monkeypatch.setattr(
        differ_module.TorchDiffer, "diff", lambda self, *a: torch_diffs.append(1) or real_diff(self, *a)
    )
    states = versions(5)
    hubs = {place: Hub() for place in ("host", "device")}
    publishers = {
        place: Publisher(MemorySink(hub), anchor_every=None, config=CONFIG, epoch=EPOCH, snapshot_on=place)
        for place, hub in hubs.items()
    }
    live: dict = {}
    receiver = Subscriber(MemorySource(hubs["device"]), copy_into(live), CONFIG)
    device = publishers["device"]
    for v, s in enumerate(states):
        trainer = clone_state(s)  # the trainer's tensors: the publisher must not keep them
        reports = {place: p.publish(trainer, version=v) for place, p in publishers.items()}
        assert {r.kind for r in reports.values()} == {"anchor" if v == 0 else "delta"}
        if v == 0:
            pointers = {k: t.data_ptr() for k, t in device.snapshot.items()}
        assert receiver.run_until(v, timeout=30)
        assert same_state(live, s) and same_state(device.snapshot, s)
        # one copy, its own (not the trainer's tensors), written in place by every delta
        assert {k: t.data_ptr() for k, t in device.snapshot.items()} == pointers
        assert all(t.data_ptr() != trainer[k].data_ptr() for k, t in device.snapshot.items() if t.numel())
    assert device._device_staging == {}
    # the device path diffed with torch (every chunk of every delta: small tensors share one);
    # the frames it sent are the host path's, record for record (same epoch, codec, changes)
    assert len(torch_diffs) >= len(states) - 1
    assert frames_of(hubs["device"]) == frames_of(hubs["host"])


def test_snapshot_on_names_its_choices():
    with pytest.raises(ValueError, match=r"snapshot_on must be one of \('host', 'device'\), got 'gpu'"):
        Publisher(MemorySink(Hub()), snapshot_on="gpu")
    with pytest.raises(ValueError, match="audit_every_s must be > 0"):
        Publisher(MemorySink(Hub()), audit_every_s=0)


def _unchanged_word(before: torch.Tensor, after: torch.Tensor) -> int:
    """A position the next version does not change (where only damage could move it)."""
    same = (before.reshape(-1).view(torch.int16) == after.reshape(-1).view(torch.int16)).nonzero()
    return int(same[len(same) // 2])


@pytest.mark.parametrize("place", ["host", "device"])
def test_damage_in_the_snapshot_is_refused_downstream_and_the_audit_heals_it_with_an_anchor(place):
    states = versions(4)
    hub = Hub()
    publisher = Publisher(
        MemorySink(hub), anchor_every=None, config=CONFIG, snapshot_on=place, audit_every_s=None
    )
    live: dict = {}
    receiver = Subscriber(MemorySource(hub), copy_into(live), CONFIG, audit_every_s=None)
    publisher.publish(states[0])
    publisher.publish(states[1])
    assert receiver.run_until(1, timeout=30)
    assert publisher.audit() == [] and publisher.publish(states[2]).kind == "delta"  # healthy: deltas go on
    assert receiver.run_until(2, timeout=30) and same_state(live, states[2])

    # A word of the snapshot flips where the next version writes nothing.
    name = "embed.weight"
    at = _unchanged_word(states[2][name], states[3][name])
    publisher.snapshot[name].reshape(-1).view(torch.int16)[at] ^= 0x10
    assert publisher.audit() == [name] and publisher.audit_damaged == [name]
    report = publisher.publish(states[3])
    assert report.kind == "anchor"  # rewrites the snapshot from the trainer's tensors
    assert receiver.run_until(3, timeout=30) and same_state(live, states[3])
    assert held_sums(publisher.snapshot) == publisher.checksums and publisher.audit() == []


def test_without_the_audit_a_damaged_snapshot_makes_receivers_refuse_and_the_timed_audit_heals_it():
    # What the audit is for: a delta built on the damaged word is refused by the receiver
    # (its weights stay at the version before); the audit, started after that publish on a
    # thread of its own once audit_every_s passed, finds the damage, and the next version
    # goes out as an anchor.
    states = versions(4)
    hub = Hub()
    publisher = Publisher(MemorySink(hub), anchor_every=None, config=CONFIG, audit_every_s=3600)
    live: dict = {}
    receiver = Subscriber(MemorySource(hub), copy_into(live), CONFIG, audit_every_s=None)
    publisher.publish(states[0])
    publisher.publish(states[1])
    assert receiver.run_until(1, timeout=30)
    name = "layer.0.mlp.weight"
    words = publisher.snapshot[name].reshape(-1).view(torch.int16)
    at = int(
        (
            states[1][name].reshape(-1).view(torch.int16) != states[2][name].reshape(-1).view(torch.int16)
        ).nonzero()[0]
    )
    words[at] ^= 0x10  # where version 2 writes: the delta is computed from the damaged word
    publisher.audit_every_s = 1e-3  # due now: the audit starts when this publish returns
    assert publisher.publish(states[2]).kind == "delta"
    publisher.wait_audit(timeout=30)
    assert publisher.audit_damaged == [name]
    assert not receiver.run_until(2, timeout=2) and same_state(live, states[1])
    assert any("digest" in r or "sum" in r or "checksum" in r for r in receiver.refused), receiver.refused
    publisher.audit_every_s = None
    assert publisher.publish(states[3]).kind == "anchor"
    assert receiver.run_until(3, timeout=30) and same_state(live, states[3])
