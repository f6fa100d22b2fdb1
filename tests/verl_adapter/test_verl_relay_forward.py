"""A ``modal_vllm`` relay forwards the frames its ``modal_delta`` receiver verified, record for
record, instead of decoding, gathering and encoding the version again
(``verl_modal.checkpoint_engine.take_verified_frames``, ``EnginePusher.forward``).

Real parts: the trainer's publisher and frame server, the relay's receiver engine, the relay's
keyed frame server, and a downstream subscriber over TCP standing where the engine's worker
extension stands (it uses the same ``tcp_subscriber``)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("verl")

from modal_rl.run_key import RUN_KEY_ENV  # noqa: E402
from modal_rl.weightsync.codec.encode import CodecConfig  # noqa: E402
from modal_rl.weightsync.subscriber import tcp_subscriber  # noqa: E402
from tests.verl_adapter.test_verl_checkpoint_engine import Cluster, trajectory  # noqa: E402
from tests.weightsync_helpers import TEST_KEY, same_state  # noqa: E402
from verl_modal import checkpoint_engine  # noqa: E402


@pytest.fixture(autouse=True)
def relay_process(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    monkeypatch.setattr(checkpoint_engine, "_relaying", True)  # keep_verified_frames(), undone after
    monkeypatch.setattr(checkpoint_engine, "_receivers", [])


def test_the_relay_forwards_the_trainers_frames_and_the_engine_gets_every_version_bit_exact(capsys):
    from modal_rl.engines.vllm_push import EnginePusher

    states = trajectory(5)
    cluster = Cluster(n_rollout=1, actor_ranks=1, anchor_every=3)
    relay, reencode = EnginePusher(None), EnginePusher(None)
    downstream = None
    rows = []
    try:
        for step, state in enumerate(states):
            metrics, outcomes = cluster.sync(state, step)
            assert outcomes == [None]
            frames = checkpoint_engine.take_verified_frames()
            assert len(frames) == 1 and checkpoint_engine.take_verified_frames() == []  # taken once
            raw = sum(t.numel() * t.element_size() for t in state.values())
            t0 = time.perf_counter()
            source, fwd = relay.forward(frames, raw)
            forward_s = time.perf_counter() - t0
            held = cluster.rollouts[0].live
            t0 = time.perf_counter()
            _, enc = reencode.publish(held)  # what the relay did before: encode the version again
            encode_s = time.perf_counter() - t0
            # the trainer's own frame, byte for byte: same size, its version, kind and epoch
            assert fwd["payload_mbytes"] == metrics["checkpoint_engine/payload_mbytes"]
            assert (fwd["version"], fwd["anchor"]) == (step, metrics["checkpoint_engine/anchor"])
            assert source.epoch == cluster.actors[0]._publisher.epoch and source.version == step
            addr = (source.host, source.port)
            downstream = tcp_subscriber(downstream, addr, step, CodecConfig(), epoch=source.epoch)
            downstream.stage_until(step, 30.0, 0, epoch=source.epoch)
            assert same_state(downstream.chain.state, state), step
            rows.append((step, fwd["payload_mbytes"], enc["payload_mbytes"], forward_s, encode_s))
        # a late engine (a replacement) catches up from the relay's retained anchor and deltas
        late = tcp_subscriber(None, addr, len(states) - 1, CodecConfig(), epoch=source.epoch)
        try:
            late.stage_until(len(states) - 1, 30.0, 0, epoch=source.epoch)
            assert same_state(late.chain.state, states[-1])
        finally:
            late.source.close()
    finally:
        if downstream is not None:
            downstream.source.close()
        relay.close()
        reencode.close()
        cluster.close()
    with capsys.disabled():
        for step, fwd_mib, enc_mib, fwd_s, enc_s in rows:
            print(
                f"\nrelay v{step}: forward {fwd_mib:.4f} MiB in {fwd_s * 1e3:.2f} ms; "
                f"re-encode {enc_mib:.4f} MiB in {enc_s * 1e3:.2f} ms"
            )


def test_a_damaged_copy_is_not_forwarded_only_the_one_the_receiver_accepted():
    # A frame damaged on the way is refused by the receiver's chain and asked for again: the
    # relay forwards the copy that was accepted, and the engine rebuilds the version from it.
    from modal_rl.engines.vllm_push import EnginePusher
    from tests.e2e.test_weightsync_faults_e2e import FlakyProxy

    states = trajectory(2)
    cluster = Cluster(n_rollout=1, actor_ranks=1, anchor_every=100)
    relay, proxy, downstream = EnginePusher(None), None, None
    try:
        assert cluster.sync(states[0], 0)[1] == [None]
        relay.forward(checkpoint_engine.take_verified_frames())
        proxy = FlakyProxy(cluster.actors[0]._server.address, "flip", at_byte=300)

        def via_proxy(ep):
            return {**ep, "host": proxy.address[0], "port": proxy.address[1]}

        assert cluster.sync(states[1], 1, rewrite_endpoint=via_proxy)[1] == [None]
        assert cluster.rollouts[0].engine.metrics["checkpoint_engine/refused"] >= 1
        frames = checkpoint_engine.take_verified_frames()
        assert len(frames) == 1
        source, _ = relay.forward(frames)
        downstream = tcp_subscriber(None, (source.host, source.port), 1, CodecConfig(), epoch=source.epoch)
        downstream.stage_until(1, 30.0, 0, epoch=source.epoch)
        assert same_state(downstream.chain.state, states[1]) and downstream.refused == []
    finally:
        if downstream is not None:
            downstream.source.close()
        if proxy is not None:
            proxy.close()
        relay.close()
        cluster.close()
