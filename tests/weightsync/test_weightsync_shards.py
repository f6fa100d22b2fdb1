"""Sharded publishing (``modal_rl.weightsync.shards``): every rank publishes only the pieces
it holds, over its own real TCP frame server; the receiver activates a version only when all
ranks staged it, and what it assembles is bit for bit the trainer's full state, whatever the
number of ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.shards import (
    ShardedReceiver,
    ShardLayoutError,
    assemble_into,
    dim0_pieces,
    parse_piece,
    piece_name,
    tile,
)
from modal_rl.weightsync.transport.store import DirectoryStore
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from tests.weightsync_helpers import TEST_KEY, model_state, perturb, same_state

CONFIG = CodecConfig(chunk_elems=4096, threads=2)


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def trajectory(n: int) -> list[dict[str, torch.Tensor]]:
    states = [model_state(3)]
    states[0]["scalar"] = torch.tensor(1.5, dtype=torch.float32)
    states[0]["few_rows"] = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)  # fewer rows than ranks
    for v in range(1, n):
        states.append(perturb(states[-1], 0.02, seed=v))
    return states


def publish_sharded(states, world: int, anchor_every: int | None = None):
    """Publish ``states`` from ``world`` rank publishers (one epoch); return the full states
    a receiver assembled at every version, the bytes per version and the publishers."""
    servers = [FrameServer(keep_anchors=1) for _ in range(world)]
    publishers = [Publisher(s, anchor_every=anchor_every, config=CONFIG, epoch=0x5EED) for s in servers]
    live: dict[str, torch.Tensor] = {}
    receiver = ShardedReceiver([TcpSource(*s.address) for s in servers], assemble_into(live), CONFIG)
    seen, sizes = [], []
    try:
        for v, state in enumerate(states):
            sizes.append(
                sum(
                    p.publish(dim0_pieces(state.items(), r, world), v).bytes for r, p in enumerate(publishers)
                )
            )
            assert receiver.run_until(v, timeout=30)
            seen.append({n: t.clone() for n, t in live.items()})
    finally:
        receiver.close()
        for s in servers:
            s.close()
    return seen, sizes, publishers


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_publishing_is_bit_identical_to_one_rank(world):
    states = trajectory(4)
    one, one_bytes, _ = publish_sharded(states, 1)
    many, many_bytes, publishers = publish_sharded(states, world)
    for v, state in enumerate(states):
        assert same_state(one[v], state) and same_state(many[v], state)
    # no rank holds the full model: each snapshot is its own shard
    full = sum(t.numel() for t in states[-1].values())
    held = [sum(t.numel() for t in p.snapshot.values()) for p in publishers]
    assert sum(held) == full and max(held) <= full // world + 4096
    # per-rank streams cost little beyond one stream (headers per rank, chunk edges)
    assert sum(many_bytes[1:]) <= 1.1 * sum(one_bytes[1:]) + 2048 * world


def test_the_kept_tiling_follows_anchors_and_deltas():
    """Deltas reuse the last tiling (same pieces, same tensors); an anchor every 2 versions
    tiles afresh: every version assembles bit for bit."""
    states = trajectory(5)
    many, _, _ = publish_sharded(states, 2, anchor_every=2)
    for v, state in enumerate(states):
        assert same_state(many[v], state), f"version {v}"


def test_a_version_is_activated_only_when_every_rank_staged_it(tmp_path):
    """Rank 1 has not published v1 yet: the receiver stages rank 0's v1 but keeps v0 live;
    once rank 1 publishes, v1 goes live whole."""
    states = trajectory(2)
    stores = [DirectoryStore(tmp_path / f"rank{r}") for r in range(2)]
    publishers = [Publisher(s, anchor_every=None, config=CONFIG, epoch=7) for s in stores]
    live: dict[str, torch.Tensor] = {}
    receiver = ShardedReceiver(
        [DirectoryStore(tmp_path / f"rank{r}") for r in range(2)], assemble_into(live), CONFIG
    )
    for r, p in enumerate(publishers):
        p.publish(dim0_pieces(states[0].items(), r, 2), 0)
    assert receiver.run_until(0, timeout=30) and same_state(live, states[0])
    publishers[0].publish(dim0_pieces(states[1].items(), 0, 2), 1)
    assert not receiver.run_until(1, timeout=1.0)
    assert receiver.live_version == 0 and same_state(live, states[0])
    publishers[1].publish(dim0_pieces(states[1].items(), 1, 2), 1)
    assert receiver.run_until(1, timeout=30) and same_state(live, states[1])


def test_ranks_at_one_version_of_two_epochs_are_not_activated(tmp_path):
    """Rank 0 is still the replaced trainer's (epoch 7), rank 1 the new one's (epoch 9), both at
    v0: no epoch named by the caller, yet nothing goes live until rank 0 reaches epoch 9."""
    states = trajectory(2)
    live: dict[str, torch.Tensor] = {}
    receiver = ShardedReceiver(
        [DirectoryStore(tmp_path / f"rank{r}") for r in range(2)], assemble_into(live), CONFIG
    )
    old = Publisher(DirectoryStore(tmp_path / "rank0"), anchor_every=None, config=CONFIG, epoch=7 << 20)
    old.publish(dim0_pieces(states[0].items(), 0, 2), 0)
    old.sink.close()  # the replaced trainer's lease goes: the new one may take the store
    new = Publisher(DirectoryStore(tmp_path / "rank1"), anchor_every=None, config=CONFIG, epoch=9 << 20)
    new.publish(dim0_pieces(states[1].items(), 1, 2), 0)
    assert not receiver.run_until(0, timeout=1.5)
    assert receiver.live_version is None and live == {}
    assert sorted(e for e, _ in receiver.staged_positions()) == [7 << 20, 9 << 20]
    rank0 = Publisher(DirectoryStore(tmp_path / "rank0"), anchor_every=None, config=CONFIG, epoch=9 << 20)
    rank0.publish(dim0_pieces(states[1].items(), 0, 2), 0)
    assert receiver.run_until(0, timeout=30) and same_state(live, states[1])
    assert set(receiver.staged_positions()) == {(9 << 20, 0)}
    receiver.close()


def test_pieces_that_do_not_tile_are_refused_by_name():
    w = torch.zeros(4, 3)
    good = dict(dim0_pieces([("w", w)], 0, 2)) | dict(dim0_pieces([("w", w)], 1, 2))
    pieces, layout = tile([good])
    assert [start for start, _ in pieces["w"]] == [0, 6] and layout["w"][0] == (4, 3)
    gap = dict(dim0_pieces([("w", w)], 0, 2))
    with pytest.raises(ShardLayoutError, match="cover 6 of 12"):
        tile([gap])
    with pytest.raises(ShardLayoutError, match="overlap"):
        tile([good, {piece_name("w", 3, (4, 3)): torch.zeros(3)}])
    with pytest.raises(ShardLayoutError, match="disagree"):
        tile([good, {piece_name("w", 12, (5, 3)): torch.zeros(3)}])
    with pytest.raises(ShardLayoutError, match="not a shard piece"):
        parse_piece("model.layers.0.weight")
    assert parse_piece(piece_name("a@b", 5, ())) == parse_piece("a@b@5:()")


def test_real_fsdp2_ranks_publish_their_local_shards_without_a_gather(tmp_path):
    """Two FSDP2 ranks (real ``fully_shard``, gloo) publish their ``Shard(0)`` local tensors;
    the receiver's assembly equals the gathered state at every version, and each rank's
    publisher held only its shard."""
    import subprocess
    import sys

    versions = 3
    done = subprocess.run(
        [sys.executable, "-m", "tests._fsdp_shard_child", str(tmp_path), str(versions)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    held = [line.split() for r in range(2) for line in (tmp_path / f"held{r}.txt").read_text().splitlines()]
    assert len(held) == 2 * versions
    assert all(int(h[1]) < int(h[2]) for h in held)  # each rank: "VERSION HELD FULL", HELD < FULL
    live: dict[str, torch.Tensor] = {}
    sources = [DirectoryStore(tmp_path / f"rank{r}") for r in range(2)]
    receiver = ShardedReceiver(sources, assemble_into(live), CodecConfig(chunk_elems=512))
    for v in range(versions):
        assert receiver.run_until(v, timeout=30)
        assert same_state(live, torch.load(tmp_path / f"full{v}.pt"))
