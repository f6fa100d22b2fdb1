"""VersionChain: anchors + deltas, rebuild of any retained version, catch-up, pruning."""

from __future__ import annotations

import pytest

from modal_rl.weightsync import CodecConfig, VersionChain, encode_anchor, encode_delta, frame_bytes
from tests.weightsync_helpers import model_state, perturb, same_state

CONFIG = CodecConfig(chunk_elems=4096, threads=2)


def trajectory(n: int):
    states = [model_state()]
    for i in range(1, n):
        states.append(perturb(states[-1], 0.02, seed=i))
    return states


def frames_for(states, anchor_every: int):
    frames = []
    for v, state in enumerate(states):
        if v % anchor_every == 0:
            frames.append(frame_bytes(encode_anchor(state, version=v, config=CONFIG)))
        else:
            frames.append(
                frame_bytes(encode_delta(states[v - 1], state, base_version=v - 1, version=v, config=CONFIG))
            )
    return frames


def test_chain_follows_anchors_and_deltas_and_rebuilds_any_version():
    states = trajectory(7)
    chain = VersionChain(CONFIG, key=None, keep_anchors=2)
    for v, frame in enumerate(frames_for(states, anchor_every=3)):
        chain.apply(frame)
        assert chain.version == v
        assert same_state(chain.state, states[v])
    assert chain.retained_versions == [3, 4, 5, 6]
    for v in chain.retained_versions:
        assert same_state(chain.rebuild(v), states[v])
    with pytest.raises(KeyError, match="not retained"):
        chain.rebuild(1)


def test_a_restarted_receiver_catches_up_from_the_last_anchor():
    states = trajectory(6)
    sender = VersionChain(CONFIG, key=None)
    for frame in frames_for(states, anchor_every=4):
        sender.apply(frame)
    fresh = VersionChain(CONFIG, key=None)
    catch_up = sender.frames_since(None)
    assert len(catch_up) == 2  # anchor 4, delta 5
    for frame in catch_up:
        fresh.apply(frame)
    assert fresh.version == 5 and same_state(fresh.state, states[5])


def test_a_receiver_behind_gets_only_the_missing_deltas():
    states = trajectory(5)
    frames = frames_for(states, anchor_every=10)
    sender, behind = VersionChain(CONFIG, key=None), VersionChain(CONFIG, key=None)
    for frame in frames:
        sender.apply(frame)
    for frame in frames[:2]:
        behind.apply(frame)
    missing = sender.frames_since(behind.version)
    assert len(missing) == 3
    for frame in missing:
        behind.apply(frame)
    assert same_state(behind.state, states[4])


def test_checksums_track_the_state():
    states = trajectory(3)
    chain = VersionChain(CONFIG, key=None, retain=False)
    for frame in frames_for(states, anchor_every=10):
        chain.apply(frame)
    fresh = VersionChain(CONFIG, key=None)
    fresh.apply(encode_anchor(states[2], version=9, config=CONFIG))
    assert chain.checksums == fresh.checksums
    assert chain.retained_versions == []
