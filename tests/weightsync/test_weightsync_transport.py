"""Publisher → transport → Subscriber, in process: store (directory, Modal Volume) and TCP."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from modal_rl.ratelimit import TokenBucket
from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.errors import WeightSyncError
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.store import DirectoryStore, ModalVolumeStore
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from tests.weightsync_helpers import TEST_KEY, client_handshake, model_state, perturb, same_state

CONFIG = CodecConfig(chunk_elems=4096, threads=2)


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    """Transports default to the run's key: these tests run keyed, as a launched run does."""
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def trajectory(n: int, density: float = 0.02):
    states = [model_state()]
    for i in range(1, n):
        states.append(perturb(states[-1], density, seed=i))
    return states


def test_store_publish_subscribe_and_restart_catch_up(tmp_path):
    states = trajectory(6)
    publisher = Publisher(DirectoryStore(tmp_path), anchor_every=3, config=CONFIG)
    live: dict = {}
    subscriber = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    kinds = []
    for v, state in enumerate(states):
        kinds.append(publisher.publish(state).kind)
        assert subscriber.run_until(v, timeout=30)
        assert same_state(live, state)
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta"]
    # Frames before the previous anchor are pruned (the previous window stays for readers
    # that may be reading it); a fresh receiver starts from the newest anchor.
    epoch = f"{publisher.epoch:016x}"
    assert sorted(p.name for p in (tmp_path / "frames").iterdir()) == [
        f"{epoch}-{v:012d}.{kind}" for v, kind in enumerate(kinds)
    ]
    restarted: dict = {}
    fresh = Subscriber(DirectoryStore(tmp_path), copy_into(restarted), CONFIG)
    assert fresh.run_until(5, timeout=30)
    assert [t.kind for t in fresh.timings] == ["anchor", "delta", "delta"]
    assert same_state(restarted, states[5])
    publisher.publish(perturb(states[5], 0.02, seed=7))  # anchor 6: window 0-2 goes
    assert sorted(p.name for p in (tmp_path / "frames").iterdir())[0] == f"{epoch}-000000000003.anchor"


class RecordingVolume:
    """Stands in for modal.Volume at the Modal-server boundary: records what a reader
    would see at each commit (the frames present and the `latest` pointer)."""

    def __init__(self, root):
        self.root = root
        self.events: list[tuple[str, set[str], int | None]] = []

    def _seen(self):
        frames = {p.name for p in (self.root / "frames").iterdir() if not p.name.startswith(".")}
        latest = self.root / "latest"
        return frames, json.loads(latest.read_text())["version"] if latest.exists() else None

    def commit(self):
        self.events.append(("commit", *self._seen()))

    def reload(self):
        self.events.append(("reload", set(), None))


def test_modal_volume_store_commits_bytes_before_the_pointer(tmp_path):
    volume = RecordingVolume(tmp_path)
    store = ModalVolumeStore(volume, tmp_path, keep_anchors=1)
    publisher = Publisher(store, anchor_every=2, config=CONFIG)
    for state in trajectory(4):
        publisher.publish(state)
    commits = [(frames, latest) for kind, frames, latest in volume.events if kind == "commit"]
    for version in range(4):
        first_pointing = next(i for i, (_, latest) in enumerate(commits) if latest == version)
        name = f"{publisher.epoch:016x}-{version:012d}.{'anchor' if version % 2 == 0 else 'delta'}"
        # The frame was committed before any commit that publishes a pointer to it.
        assert any(name in frames for frames, _ in commits[:first_pointing])
    reader = ModalVolumeStore(volume, tmp_path)
    before = len(volume.events)
    assert reader.next_frame(None, timeout=1) is not None
    assert ("reload", set(), None) in volume.events[before:]


def test_tcp_fan_out_to_two_receivers_with_catch_up():
    states = trajectory(5)
    server = FrameServer(keep_anchors=1)
    publisher = Publisher(server, anchor_every=10, config=CONFIG)
    try:
        publisher.publish(states[0])
        publisher.publish(states[1])
        lives = [{}, {}]
        subs = [Subscriber(TcpSource(*server.address), copy_into(lv), CONFIG) for lv in lives]
        for sub in subs:  # joining late: anchor 0 and delta 1 come from the retained frames
            assert sub.run_until(1, timeout=30)
        for v in range(2, 5):
            publisher.publish(states[v])
            for sub, live in zip(subs, lives, strict=True):
                assert sub.run_until(v, timeout=30)
                assert same_state(live, states[v])
        assert [t.kind for t in subs[0].timings] == ["anchor", "delta", "delta", "delta", "delta"]
    finally:
        for sub in locals().get("subs", []):
            sub.source.close()
        server.close()


def test_a_stalled_receiver_is_dropped_within_the_back_pressure_bound():
    # Frames large enough (~6 MB each) that kernel socket buffers cannot hide the stall.
    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(3_000_000, generator=gen).to(torch.bfloat16)} for _ in range(4)]
    server = FrameServer(max_buffer_bytes=1 << 20, slow_timeout_s=0.5)
    publisher = Publisher(server, anchor_every=1, config=CONFIG)  # anchors: big frames
    stalled = socket.create_connection(server.address)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client_handshake(stalled, TEST_KEY)  # admitted, then never reads
    live: dict = {}
    healthy = Subscriber(TcpSource(*server.address), copy_into(live), CONFIG)
    got = threading.Thread(target=healthy.run_until, args=(3, 60))
    got.start()
    try:
        time.sleep(0.3)
        started = time.monotonic()
        for state in states:
            publisher.publish(state)
        elapsed = time.monotonic() - started
        got.join(60)
        assert same_state(live, states[3])
        assert server.dropped == 1
        # One stall of at most slow_timeout_s, not one per frame or an unbounded one.
        assert elapsed < 0.5 + 5.0
    finally:
        stalled.close()
        healthy.source.close()
        server.close()


def test_token_bucket_limits_the_rate():
    bucket = TokenBucket(rate=2_000_000, burst=10_000)
    started = time.monotonic()
    for _ in range(50):
        bucket.acquire_blocking(20_000)  # 1 MB at 2 MB/s
    assert 0.4 < time.monotonic() - started < 2.0
    with pytest.raises(ValueError):
        TokenBucket(0)


def test_a_relay_re_serves_what_it_receives():
    states = trajectory(4)
    upstream, relay_server = FrameServer(), FrameServer()
    relay = Subscriber(TcpSource(*upstream.address, on_record=relay_server.forward), copy_into({}), CONFIG)
    live: dict = {}
    downstream = Subscriber(TcpSource(*relay_server.address), copy_into(live), CONFIG)
    publisher = Publisher(upstream, anchor_every=10, config=CONFIG)
    try:
        for v, state in enumerate(states):
            publisher.publish(state)
            assert relay.run_until(v, timeout=30)
            assert downstream.run_until(v, timeout=30)
            assert same_state(live, state)
        assert [t.kind for t in downstream.timings] == ["anchor", "delta", "delta", "delta"]
    finally:
        relay.source.close()
        downstream.source.close()
        upstream.close()
        relay_server.close()


def test_the_publisher_holds_one_copy_and_deltas_write_only_into_it(tmp_path):
    """The snapshot is the publisher's only copy of the state: an anchor copies into it, and
    each delta diffs the caller's tensors where they lie and writes the changed words into
    the same buffers (no second host copy, no per-version allocation). The caller's tensors
    are only read, and a receiver still gets every version bit for bit."""
    states = trajectory(4)
    publisher = Publisher(DirectoryStore(tmp_path), anchor_every=None, config=CONFIG)
    publisher.publish(states[0])
    buffers = {n: t.data_ptr() for n, t in publisher.snapshot.items()}
    assert all(buffers[n] != t.data_ptr() for n, t in states[0].items() if t.numel())
    for v in (1, 2, 3):
        before = {n: t.clone() for n, t in states[v].items()}
        assert publisher.publish(states[v]).kind == "delta"
        assert {n: t.data_ptr() for n, t in publisher.snapshot.items()} == buffers
        assert same_state(publisher.snapshot, states[v])
        assert same_state(states[v], before)  # read, never written
    live: dict = {}
    assert Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG).run_until(3, timeout=30)
    assert same_state(live, states[3])


def test_a_failed_delta_leaves_a_mixed_snapshot_that_the_next_anchor_rewrites(tmp_path):
    """A delta that fails part way (here: the fourth tensor has a new shape) has already
    written some chunks into the snapshot; the next publish is an anchor, so what the
    receivers get stays exact."""
    states = trajectory(3)
    publisher = Publisher(DirectoryStore(tmp_path), anchor_every=None, config=CONFIG)
    publisher.publish(states[0])
    names = list(states[1])
    broken = ((n, t if i != 3 else t.reshape(-1)[:-1]) for i, (n, t) in enumerate(states[1].items()))
    with pytest.raises(WeightSyncError):
        publisher.publish(broken)
    assert any(not torch.equal(publisher.snapshot[n], states[0][n]) for n in names[:3])
    assert publisher.publish(states[2], version=2).kind == "anchor"
    live: dict = {}
    assert Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG).run_until(2, timeout=30)
    assert same_state(live, states[2])


def test_a_server_that_keeps_no_anchor_holds_no_frame_but_still_streams():
    """``keep_anchors=0`` (the model-scale publisher: no compressed copy of the model beside
    its snapshot): nothing is retained, connected receivers still get every version."""
    states = trajectory(3)
    server = FrameServer(keep_anchors=0)
    live: dict = {}
    sub = Subscriber(TcpSource(*server.address), copy_into(live), CONFIG)
    publisher = Publisher(server, anchor_every=None, config=CONFIG)
    try:
        for v, state in enumerate(states):
            got = threading.Thread(target=sub.run_until, args=(v, 30))
            got.start()  # connects (once) and waits for version v
            deadline = time.monotonic() + 30
            while server.receivers < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert publisher.publish(state).bytes > 0
            got.join(30)
            assert sub.reached(v) and same_state(live, state)
            assert server.retained == []
    finally:
        sub.source.close()
        server.close()
