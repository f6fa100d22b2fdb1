"""Round 3 (issue 35), item 4: nothing unsigned decides anything in a store.

Real directory stores, real publishers and receivers. Planted names never decide an epoch or
what is pruned; squatters of any kind at ``latest`` / ``lease`` are moved aside and reported;
a successor's lease record names the epoch it took over from, so a replayed record of a
simultaneous start's loser does not stop the winner.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.errors import LeaseLostError
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.lease import StoreLease
from modal_rl.weightsync.transport.store import DirectoryStore
from tests.weightsync_helpers import TEST_KEY, perturb, same_state

CONFIG = CodecConfig(threads=1)


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def trajectory(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}]
    for i in range(1, n):
        states.append(perturb(states[-1], 0.1, seed=i))
    return states


def frames(root) -> list[str]:
    return sorted(p.name for p in (root / "frames").iterdir())


def test_planted_frame_names_prune_nothing_and_decide_no_epoch(tmp_path):
    (tmp_path / "frames").mkdir()
    for name in ("fffffffffffffffe-000000000001.anchor", "fffffffffffffffe-000000000002.anchor"):
        (tmp_path / "frames" / name).write_bytes(b"")  # empty files, anyone can make them
    (tmp_path / "frames" / "ffffffffffffffff-000000000000.anchor").write_bytes(b"")
    states = trajectory(5)
    pub = Publisher(DirectoryStore(tmp_path, keep_anchors=2, heartbeat=False), config=CONFIG, anchor_every=2)
    for s in states:  # before: "epoch out of range" at the first publish
        pub.publish(s)
    assert pub.epoch < 0xFFFFFFFFFFFFFFFE  # a fresh epoch, not one above the planted names
    mine = [n for n in frames(tmp_path) if n.startswith(f"{pub.epoch:016x}")]
    assert any(n.endswith(".anchor") for n in mine) and len(mine) >= 3  # before: all pruned
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    assert receiver.run_until(4, timeout=20, epoch=pub.epoch) and same_state(live, states[4])
    pub.sink.close()


@pytest.mark.parametrize("name", ["latest", "lease", ".latest.partial"])
@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_a_squatter_at_a_store_name_is_moved_aside_and_reported(tmp_path, name, kind, caplog):
    caplog.set_level(logging.WARNING)
    path = tmp_path / name
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_text("x")
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_text("untouched")
        path.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(path)
    states = trajectory(2)
    store = DirectoryStore(tmp_path, heartbeat=False)
    pub = Publisher(store, config=CONFIG)
    for s in states:  # before (directory): IsADirectoryError stops the trainer
        pub.publish(s)
    target = tmp_path / name.removeprefix(".").removesuffix(".partial")
    assert target.is_file() and not target.is_symlink()
    assert store.squatters and all(p.name.startswith(f".{name}.squatter-") for p in store.squatters)
    assert any("moved aside" in r.getMessage() for r in caplog.records)
    if kind == "symlink":
        assert (tmp_path / "elsewhere").read_text() == "untouched"  # never written through
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    assert receiver.run_until(1, timeout=20, epoch=pub.epoch) and same_state(live, states[1])
    pub.sink.close()


def test_a_successor_names_the_epoch_it_took_over_from(tmp_path):
    states = trajectory(2)
    first = Publisher(DirectoryStore(tmp_path, lease_ttl_s=0.3, heartbeat=False), config=CONFIG)
    first.publish(states[0])
    first.sink.close()
    second = Publisher(DirectoryStore(tmp_path, lease_wait_s=0, heartbeat=False), config=CONFIG)
    second.publish(states[1])
    record = json.loads((tmp_path / "lease").read_text())
    assert record["after"] == first.epoch and record["epoch"] > first.epoch
    second.sink.close()


def test_a_replayed_loser_of_a_simultaneous_start_does_not_stop_the_winner(tmp_path):
    """Two trainers start at once: each sees an empty store. The loser's record (written, then
    overwritten by the winner's) is of a *newer* epoch but names none it took over from; copied
    back, it must not stop the winner. A real successor (naming the winner's epoch) still does."""
    states = trajectory(4)
    winner = Publisher(DirectoryStore(tmp_path, lease_ttl_s=0.3, heartbeat=False), config=CONFIG)
    winner.publish(states[0])
    # The loser, as it was at the same instant: an empty store of its own view.
    loser_view = tmp_path.parent / (tmp_path.name + "-loser")
    loser_view.mkdir()
    loser = StoreLease(
        loser_view, winner.sink.keys, lambda p, d: p.write_bytes(d), lambda: None, heartbeat=False
    )
    loser_epoch = loser.acquire("run", winner.epoch + 1000)
    assert loser_epoch > winner.epoch
    shutil.copy(loser_view / "lease", tmp_path / "lease")  # replayed: no key needed
    assert winner.publish(states[1]).version == 1  # before: LeaseLostError, for good
    assert json.loads((tmp_path / "lease").read_text())["holder"] == winner.sink.lease.holder
    # A real successor, once the winner's lease lapsed, does stop it.
    time.sleep(0.4)
    successor = Publisher(DirectoryStore(tmp_path, lease_wait_s=0, heartbeat=False), config=CONFIG)
    successor.publish(states[2])
    with pytest.raises(LeaseLostError, match="took it"):
        winner.publish(states[3])
    successor.sink.close()
