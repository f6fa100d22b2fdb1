"""The transport ports say everything the publisher and subscriber use: a transport written
only against them (``tests/memory_transport.py``) gets the lease, recovery anchors and
streaming receive; the publisher and subscriber probe nothing."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.errors import LeaseLostError
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.base import FrameSink, FrameSource
from tests.memory_transport import Hub, MemorySink, MemorySource
from tests.weightsync_helpers import TEST_KEY, perturb, same_state

CONFIG = CodecConfig(threads=1)
PACKAGE = Path(__file__).resolve().parents[2] / "modal_rl" / "weightsync"


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def state(seed: int, words: int = 200_000) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(words, generator=gen).to(torch.bfloat16) for i in range(4)}


@pytest.mark.parametrize("module", ["publisher.py", "subscriber.py"])
def test_the_publisher_and_subscriber_probe_nothing_of_their_transport(module):
    tree = ast.parse((PACKAGE / module).read_text())
    probes = [
        f"{node.func.id}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "signature")
    ]
    probes += [
        f"inspect:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom) and "inspect" in ast.unparse(n)
    ]
    assert probes == []


def test_the_ports_state_defaults_for_every_optional_capability():
    class Minimal(FrameSink):
        def send(self, header, records):
            return sum(map(len, records))

        def close(self):
            pass

    sink = Minimal()
    assert sink.open_epoch("run", 7) == 7 and not sink.recovery_anchors
    assert sink.link_share_bytes_per_s is None and sink.receiver_costs is None and sink.keys is None
    with pytest.raises(TypeError):  # a source without next_frame is not a source
        type("Nothing", (FrameSource,), {"close": lambda self: None})()
    publisher = Publisher(sink, anchor_every=None, recovery_every=1, config=CONFIG)
    assert publisher.publish(state(0)).recovery_bytes == 0  # no anchor encoded for a sink that keeps none
    assert publisher.publish(perturb(state(0), 0.01, seed=1)).kind == "delta"


def test_a_memory_transport_gets_the_lease_through_the_port():
    hub = Hub()
    old = Publisher(MemorySink(hub), config=CONFIG)
    old.publish(state(0))
    new = Publisher(MemorySink(hub), config=CONFIG, start_version=1)
    assert new.epoch > old.epoch
    new.publish(state(1))
    with pytest.raises(LeaseLostError):  # the replaced trainer stops at its next version
        old.publish(state(2))
    live: dict = {}
    receiver = Subscriber(MemorySource(hub), copy_into(live), CONFIG)
    assert receiver.run_until(1, timeout=10, epoch=new.epoch) and same_state(live, state(1))


def test_a_memory_transport_streams_records_into_the_decoder_as_they_are_sent():
    """The subscriber decodes a frame's first record while the sink is still sending it: the
    sink holds the frame's rest until a record was read (a whole-frame fetch would deadlock
    until the sink's 10 s wait ran out, and the test would see no read before the last send)."""
    hub = Hub()
    publisher = Publisher(MemorySink(hub), config=CodecConfig(threads=1, chunk_elems=1 << 15))
    live: dict = {}
    receiver = Subscriber(MemorySource(hub), copy_into(live), CONFIG)
    hub.hold_after = 2
    done = threading.Event()
    worker = threading.Thread(target=lambda: (receiver.run_until(0, timeout=30), done.set()))
    worker.start()
    publisher.publish(state(3))
    worker.join(30)
    assert done.is_set() and same_state(live, state(3))
    sent = [i for kind, i in hub.events if kind == "sent"]
    first_read = hub.events.index(("read", 0))
    last_sent = max(j for j, (kind, _) in enumerate(hub.events) if kind == "sent")
    assert len(sent) > 4 and first_read < last_sent
    assert receiver.timings[-1].bytes == receiver.source.last_frame_bytes > 0


def test_an_audit_finds_a_held_tensor_damaged_outside_the_deltas_and_the_receiver_heals_from_an_anchor():
    # Deltas are verified by the sums their changes moved, which cannot see a word damaged
    # where no delta writes; the timed full audit does, and the receiver then takes the
    # anchor again instead of building on the damage.
    hub = Hub()
    publisher = Publisher(MemorySink(hub), anchor_every=None, config=CONFIG)
    live: dict = {}
    receiver = Subscriber(MemorySource(hub), copy_into(live), CONFIG, audit_every_s=None)
    publisher.publish(state(0))
    publisher.publish(state(1))
    assert receiver.run_until(1, timeout=30)
    assert receiver.audit() == [] and receiver.chain.version == 1  # healthy: nothing changes
    receiver.chain.state["layer2.weight"].view(torch.int16)[7] ^= 1
    assert receiver.audit() == ["layer2.weight"] and receiver.chain.version is None
    assert "audit" in receiver.refused[-1]
    activated_before = len(receiver.timings)
    publisher.publish(state(2))
    assert receiver.run_until(2, timeout=30)
    assert same_state(live, state(2)) and same_state(receiver.chain.state, state(2))
    # healed through the anchor, which was staged but not activated: live never went back
    assert [t.version for t in receiver.timings[activated_before:]] in ([1, 2], [2])
