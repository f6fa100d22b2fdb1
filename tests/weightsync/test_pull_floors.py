"""Round 3 (issue 35), item 5: floors everywhere on an engine's weight pulls.

The engine side of a pull (``DeltaWeightsExtension._modal_rl_verified_subscriber``, as vLLM's
workers run it, holding only the frame-read key) against real frame servers: a signed pull
that arrives late (an older version) is refused before anything is dialled, and a pull that
names a replaced trainer's server (still running, older epoch) keeps the engine's chain and
floor, so the stale weights are never staged.
"""

from __future__ import annotations

import json

import pytest
import torch

from modal_rl.run_key import FRAME_READ_ENV, RUN_KEY_ENV, frame_read_key
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.apply.vllm_extension import DeltaWeightsExtension, pull_request
from modal_rl.weightsync.errors import PullRefusedError, VersionNotReachedError
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.transport.tcp import FrameServer
from tests.weightsync_helpers import TEST_KEY, perturb, same_state

CONFIG = CodecConfig(threads=1)


def trajectory(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    states = [{"w": torch.randn(32, 32, generator=g)}]
    for i in range(1, n):
        states.append(perturb(states[-1], 0.1, seed=seed * 100 + i))
    return states


@pytest.fixture
def engine(monkeypatch):
    """The worker extension as an engine holds it: the frame-read key, no run key."""
    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    monkeypatch.setenv(FRAME_READ_ENV, frame_read_key(TEST_KEY))
    ext = DeltaWeightsExtension()
    yield ext
    sub = getattr(ext, "_modal_rl_subscriber", None)
    if sub is not None:
        sub.source.close()


def serve(states, epoch: int) -> tuple[FrameServer, Publisher]:
    server = FrameServer(key=TEST_KEY, keep_anchors=4)
    pub = Publisher(server, config=CONFIG, epoch=epoch, anchor_every=None)
    for s in states:
        pub.publish(s)
    return server, pub


def pull(ext, server, version: int, epoch: int | None):
    body = pull_request(*server.address, version, timeout_s=10, key=TEST_KEY, epoch=epoch)
    request, signature = body["args"]
    sub, req = ext._modal_rl_verified_subscriber(request, signature)
    return sub, json.loads(request)


def test_a_late_signed_pull_for_an_older_version_is_refused(engine):
    states = trajectory(4, seed=1)
    server, pub = serve(states, epoch=5 << 20)
    try:
        sub, _ = pull(engine, server, 3, pub.epoch)
        sub.stage_until(3, 10, 0)
        assert sub.live_version == 3 and same_state(sub.chain.state, states[3])
        for epoch in (pub.epoch, None):  # signed, fresh nonce: only its version is old
            with pytest.raises(PullRefusedError, match="below the v3 this engine holds"):
                pull(engine, server, 1, epoch)
        assert sub.live_version == 3 and same_state(sub.chain.state, states[3])
    finally:
        server.close()


def test_a_pull_naming_a_replaced_trainers_server_loads_nothing_stale(engine):
    stale_states = trajectory(6, seed=2)
    live_states = trajectory(3, seed=3)
    stale, old_pub = serve(stale_states, epoch=7 << 20)  # replaced, still running
    live, new_pub = serve(live_states, epoch=9 << 20)
    try:
        sub, _ = pull(engine, live, 2, new_pub.epoch)
        sub.stage_until(2, 10, 0)
        assert (sub.live_epoch, sub.live_version) == (new_pub.epoch, 2)
        # The replaced trainer signs with its own (older) epoch: refused before dialling.
        with pytest.raises(PullRefusedError, match="below the v2"):
            pull(engine, stale, 5, old_pub.epoch)
        # A pull without an epoch (an older pusher) passes the version check, but the chain and
        # its floor stay: the stale server's older epoch is refused, nothing of it is staged.
        kept, _ = pull(engine, stale, 5, None)
        assert kept is sub and kept.floor == (new_pub.epoch, 2)
        with pytest.raises(VersionNotReachedError):
            kept.stage_until(5, 3, 0)
        assert (sub.live_epoch, sub.live_version) == (new_pub.epoch, 2)
        assert same_state(sub.chain.state, live_states[2])
        assert stale.epoch == old_pub.epoch  # a receiver's hello changes no server
    finally:
        stale.close()
        live.close()
