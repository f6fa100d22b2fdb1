"""Epochs, leases and recovery anchors: one trainer at a time, restarts that never collide,
catch-up that never replays the whole chain. Real stores on disk, real sockets on 127.0.0.1."""

from __future__ import annotations

import io
import json
import struct
import time

import pytest
import torch

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig, VersionChain
from modal_rl.weightsync.errors import (
    CorruptFrameError,
    EpochMismatchError,
    LeaseHeldError,
    LeaseLostError,
    StaleEpochError,
)
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.store import DirectoryStore
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from modal_rl.weightsync.wire.frames import MAGIC, VersionHeader, read_records, record
from tests.memory_transport import Hub, MemorySink, MemorySource
from tests.weightsync_helpers import TEST_KEY, bits, perturb, same_state

CONFIG = CodecConfig(threads=1)


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def small_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 64, generator=gen).to(torch.bfloat16),
        "b": torch.randn(64, generator=gen).to(torch.bfloat16),
    }


def trajectory(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    states = [small_state(seed)]
    for v in range(1, n):
        states.append(perturb(states[-1], 0.02, seed=seed * 1000 + v))
    return states


def test_a_second_publisher_for_a_live_run_is_refused(tmp_path):
    states = trajectory(3)
    first = Publisher(DirectoryStore(tmp_path, lease_wait_s=0), config=CONFIG)
    first.publish(states[0])
    with pytest.raises(LeaseHeldError) as info:
        Publisher(DirectoryStore(tmp_path, lease_wait_s=0), config=CONFIG)
    message = str(info.value)
    assert "\n" not in message and first.sink.lease.holder in message
    assert "UTC" in message and "Stop it" in message and f"{first.epoch:016x}" in message
    # The first trainer keeps publishing, and receivers see only its epoch.
    first.publish(states[1])
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    assert receiver.run_until(1, timeout=20, epoch=first.epoch)
    assert same_state(live, states[1]) and receiver.status()["epoch"] == first.epoch
    # Once the first gives its lease up (end of its run), the next starts at once, in a newer epoch.
    first.sink.close()
    second = Publisher(DirectoryStore(tmp_path, lease_wait_s=0), config=CONFIG, start_version=2)
    assert second.epoch > first.epoch
    second.sink.close()


def test_a_restarted_trainer_never_collides_with_what_receivers_hold(tmp_path):
    """Receiver holds epoch-1 v5; the trainer restarts from its checkpoint at v3 and trains on
    differently: the receiver ends at the new epoch's anchor (v3) and its deltas, never mixing."""
    old = trajectory(6)
    first = Publisher(
        DirectoryStore(tmp_path, lease_ttl_s=0.5, heartbeat=False), anchor_every=4, config=CONFIG
    )
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    for state in old:
        first.publish(state)
    assert receiver.run_until(5, timeout=20) and same_state(live, old[5])
    old_delta = next(p for p in (tmp_path / "frames").iterdir() if p.name.endswith("-000000000005.delta"))
    old_frame = old_delta.read_bytes()

    # The trainer is killed (its lease is not renewed) and restarted from the step-3 checkpoint:
    # the new start waits for the lease to lapse, then resumes numbering at 3 with an anchor.
    second = Publisher(
        DirectoryStore(tmp_path, lease_wait_s=10), anchor_every=4, config=CONFIG, start_version=3
    )
    assert second.epoch > first.epoch
    new4 = perturb(old[3], 0.02, seed=4242)  # it trains differently from the checkpoint on
    assert second.publish(old[3]).kind == "anchor"
    assert second.publish(new4).kind == "delta"
    assert receiver.run_until(4, timeout=20, epoch=second.epoch)
    assert same_state(live, new4) and not same_state(live, old[4])
    assert [(t.epoch, t.version, t.kind) for t in receiver.timings[-2:]] == [
        (second.epoch, 3, "anchor"),
        (second.epoch, 4, "delta"),
    ]
    # The replaced trainer is stopped: its lease was taken.
    with pytest.raises(LeaseLostError):
        first.publish(perturb(old[5], 0.02, seed=6))

    # At the chain level: a frame of the old epoch is stale, a new-epoch delta needs its anchor.
    chain = VersionChain(CONFIG)
    new_delta = next(p for p in (tmp_path / "frames").iterdir() if p.name.endswith("-000000000004.delta"))
    for frame in sorted((tmp_path / "frames").iterdir()):
        if frame.name.startswith(f"{second.epoch:016x}") and frame.name.endswith("3.anchor"):
            chain.apply(frame.read_bytes())
    held = {k: bits(v) for k, v in chain.state.items()}
    with pytest.raises(StaleEpochError):
        chain.apply(old_frame)
    assert {k: bits(v) for k, v in chain.state.items()} == held and chain.version == 3
    # A receiver of the old epoch at v3 (the new delta's base number) refuses the new delta.
    at_old = VersionChain(CONFIG)
    at_old.epoch, at_old.version, at_old.run = first.epoch, 3, first.run
    with pytest.raises(EpochMismatchError, match="starts with its anchor"):
        at_old.apply(new_delta.read_bytes())
    assert (at_old.epoch, at_old.version, at_old.state) == (first.epoch, 3, {})
    second.sink.close()


def test_a_trainer_whose_lease_lapsed_stops_publishing(tmp_path):
    states = trajectory(3)
    first = Publisher(DirectoryStore(tmp_path, lease_ttl_s=0.3, heartbeat=False), config=CONFIG)
    first.publish(states[0])
    time.sleep(0.4)  # paused past its lease (a GC pause, a stalled volume): the lease lapses
    second = Publisher(DirectoryStore(tmp_path, lease_wait_s=0), config=CONFIG)
    second.publish(states[0])
    with pytest.raises(LeaseLostError) as info:
        first.publish(states[1])
    assert "\n" not in str(info.value) and second.sink.lease.holder in str(info.value)
    with pytest.raises(LeaseLostError):  # and at every later try
        first.publish(states[2], version=5)
    names = sorted(p.name for p in (tmp_path / "frames").iterdir())
    assert not any(n.startswith(f"{first.epoch:016x}-000000000001") for n in names)
    assert json.loads((tmp_path / "latest").read_text())["epoch"] == second.epoch
    second.sink.close()


@pytest.mark.parametrize("transport", ["store", "tcp", "memory"])
def test_a_cold_receiver_on_a_200_version_chain_reads_one_anchor_window(tmp_path, transport):
    """Live receivers get only deltas; a receiver that starts after 200 versions reads one
    recovery anchor and fewer than ``recovery_every`` deltas, not the chain. ``memory``: a
    transport written only against the declared ports (``tests/memory_transport.py``)."""
    every = 10
    if transport == "store":
        sink = DirectoryStore(tmp_path, lease_wait_s=0)
        source = lambda: DirectoryStore(tmp_path)  # noqa: E731
    elif transport == "memory":
        hub = Hub()
        sink, source = MemorySink(hub), lambda: MemorySource(hub)  # noqa: E731
    else:
        sink = FrameServer("127.0.0.1", 0)
        source = lambda: TcpSource(*sink.address)  # noqa: E731
    publisher = Publisher(sink, anchor_every=None, recovery_every=every, config=CONFIG)
    live: dict = {}
    follower = Subscriber(source(), copy_into(live), CONFIG)
    state = small_state(7)
    for v in range(200):
        if v:
            state = perturb(state, 0.01, seed=v)
        report = publisher.publish(state)
        assert report.kind == ("anchor" if v == 0 else "delta")
        assert (report.recovery_bytes > 0) == (v > 0 and v % every == 0)
        assert follower.run_until(v, timeout=30)
    assert follower.run_until(199, timeout=30) and same_state(live, state)
    assert [t.kind for t in follower.timings].count("anchor") == 1  # live: one anchor ever

    cold: dict = {}
    late = Subscriber(source(), copy_into(cold), CONFIG)
    t0 = time.perf_counter()
    assert late.run_until(199, timeout=30)
    seconds = time.perf_counter() - t0
    kinds = [t.kind for t in late.timings]
    assert kinds[0] == "anchor" and kinds.count("anchor") == 1 and len(kinds) <= 1 + every
    assert late.timings[0].version == 190 and same_state(cold, state)
    read = sum(t.bytes for t in late.timings)
    replay = sum(t.bytes for t in follower.timings)
    print(
        f"{transport}: cold receiver read {len(kinds)} frames, {read} B in {seconds:.2f}s; replay {replay} B"
    )
    assert read < replay / 3
    if transport == "store":
        assert late.source.bytes_read == read
        # GC keeps the current window and the previous one (a reader may be in it), no more.
        versions = sorted({int(p.name[17:29]) for p in (tmp_path / "frames").iterdir()})
        assert versions[0] == 180 and versions[-1] == 199
        sink.close()
    else:
        late.source.close()
        follower.source.close()
        sink.close()


def test_a_replaced_frame_server_is_refused_and_a_hello_changes_nothing():
    """TCP: the epoch is the lease. A receiver that moved to the new trainer's epoch refuses
    the old server (still running), whose next publish then raises."""
    states = trajectory(3)
    old_server = FrameServer("127.0.0.1", 0)
    old = Publisher(old_server, config=CONFIG)
    old.publish(states[0])
    new_server = FrameServer("127.0.0.1", 0)
    new = Publisher(new_server, config=CONFIG, start_version=0)
    assert new.epoch > old.epoch
    new.publish(states[1])
    live: dict = {}
    receiver = Subscriber(TcpSource(*new_server.address), copy_into(live), CONFIG)
    assert receiver.run_until(0, timeout=20, epoch=new.epoch) and same_state(live, states[1])
    # Pointed at the old server (a stale address), the receiver is refused and keeps its weights.
    receiver.source.close()
    receiver.source = TcpSource(*old_server.address)
    assert receiver.poll(timeout=2) is None
    assert receiver.refused and "replaced" in receiver.refused[-1]
    assert same_state(live, states[1]) and receiver.live_epoch == new.epoch
    # A hello is a peer's unsigned claim: it changes no server. The replaced trainer can still
    # publish (its lease or its launcher stops it), and the receiver that moved on refuses it.
    old.publish(states[2])
    assert receiver.poll(timeout=2) is None and same_state(live, states[1])
    receiver.source.close()
    for server in (old_server, new_server):
        server.close()


def test_a_format_1_frame_is_refused_by_name():
    body = MAGIC + struct.pack("<H", 1) + json.dumps(VersionHeader("anchor", 0, None).__dict__).encode()
    frame = record(b"V", body)
    with pytest.raises(CorruptFrameError, match="format version 1, written before frames named their run"):
        VersionHeader.from_body(next(read_records(io.BytesIO(frame), keys=None))[1])
