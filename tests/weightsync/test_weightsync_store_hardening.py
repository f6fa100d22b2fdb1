"""Issue 22 (items 3-5): whoever can write a frame store, without the run's key, can neither
stop the live trainer, nor crash or hang a receiver, nor roll a receiver back below what it
has seen signed. Real stores on disk, real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import pytest
import torch

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.errors import LeaseHeldError, LeaseLostError
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.store import DirectoryStore
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from tests.weightsync_helpers import TEST_KEY, perturb, same_state

CONFIG = CodecConfig(threads=1)
GIB = 1 << 30


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def trajectory(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    states = [{"w": torch.randn(256, 64, generator=gen).to(torch.bfloat16)}]
    for v in range(1, n):
        states.append(perturb(states[-1], 0.02, seed=seed * 1000 + v))
    return states


def frame_file(root, version: int, kind: str):
    return next((root / "frames").glob(f"*-{version:012d}.{kind}"))


def holder(root) -> str:
    return json.loads((root / "lease").read_text())["holder"]


# -- item 3: the lease ------------------------------------------------------------------------


def test_a_replayed_lease_record_leaves_the_live_trainer_publishing(tmp_path):
    states = trajectory(6)
    first = Publisher(DirectoryStore(tmp_path, lease_ttl_s=0.3, heartbeat=False), config=CONFIG)
    first.publish(states[0])
    live_copy = (tmp_path / "lease").read_bytes()  # anyone who can read the store keeps a copy
    first.sink.close()
    released_copy = (tmp_path / "lease").read_bytes()
    second = Publisher(
        DirectoryStore(tmp_path, lease_wait_s=0, heartbeat=False), config=CONFIG, start_version=1
    )
    second.publish(states[1])
    for version, replay in enumerate((live_copy, released_copy), start=2):
        (tmp_path / "lease").write_bytes(replay)  # copied back: no key needed
        assert second.publish(states[version]).version == version  # before: LeaseLostError, for good
        assert holder(tmp_path) == second.sink.lease.holder  # its own record is back
    (tmp_path / "lease").write_bytes(live_copy)
    second.sink.lease.renew()  # the heartbeat's path too
    assert holder(tmp_path) == second.sink.lease.holder
    # A live second trainer is still refused, and receivers follow the live one.
    with pytest.raises(LeaseHeldError):
        Publisher(DirectoryStore(tmp_path, lease_wait_s=0), config=CONFIG)
    second.publish(states[4])
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    assert receiver.run_until(4, timeout=20, epoch=second.epoch) and same_state(live, states[4])
    second.sink.close()


def test_a_replaced_trainer_stops_even_when_its_successor_has_gone_too(tmp_path):
    """A record of a newer epoch is a successor's, whatever its expiry: receivers may hold its
    epoch, so the older trainer must not come back (only older epochs are ignored)."""
    states = trajectory(2)
    first = Publisher(DirectoryStore(tmp_path, lease_ttl_s=0.3, heartbeat=False), config=CONFIG)
    first.publish(states[0])
    time.sleep(0.4)
    second = Publisher(DirectoryStore(tmp_path, lease_wait_s=0, heartbeat=False), config=CONFIG)
    second.publish(states[0])
    second.sink.close()  # its record is released (expired) now
    with pytest.raises(LeaseLostError, match="took it"):
        first.publish(states[1])


def test_a_replayed_lease_record_does_not_let_a_second_trainer_in(tmp_path):
    """The replay lands between two heartbeats and a second trainer starts right then: the
    signed ``latest`` of a newer epoch, written within a ttl, shows the store is held."""
    states = trajectory(2)
    old = Publisher(DirectoryStore(tmp_path, lease_wait_s=0, heartbeat=False), config=CONFIG)
    old.publish(states[0])
    old.sink.close()
    replay = (tmp_path / "lease").read_bytes()
    live = Publisher(DirectoryStore(tmp_path, lease_wait_s=0, heartbeat=False), config=CONFIG)
    live.publish(states[0])
    (tmp_path / "lease").write_bytes(replay)
    with pytest.raises(LeaseHeldError, match="newer than the lease record") as info:
        Publisher(DirectoryStore(tmp_path, lease_wait_s=0), config=CONFIG)
    assert "\n" not in str(info.value)
    assert live.publish(states[1]).version == 1 and holder(tmp_path) == live.sink.lease.holder
    live.sink.close()


# -- item 4: planted frame files ----------------------------------------------------------------


def published(root, n: int = 2) -> tuple[Publisher, list[dict[str, torch.Tensor]]]:
    states = trajectory(n)
    publisher = Publisher(DirectoryStore(root, lease_wait_s=0), anchor_every=None, config=CONFIG)
    for state in states:
        publisher.publish(state)
    return publisher, states


def refused_once_and_unchanged(receiver: Subscriber, live: dict, what: str) -> None:
    for _ in range(3):  # refused once, then waited out: no log flood, no busy loop
        assert receiver.poll(timeout=0.3) is None
    assert len(receiver.refused) == 1, receiver.refused
    assert what in receiver.refused[0] and "\n" not in receiver.refused[0]
    assert receiver.live_version is None and receiver.chain.version is None and live == {}


@pytest.mark.parametrize("planted", ["zeros", "frame_then_hole", "huge_record"])
def test_a_64_gib_sparse_frame_file_is_refused_unread(tmp_path, planted, caplog):
    publisher, states = published(tmp_path)
    anchor = frame_file(tmp_path, 0, "anchor")
    saved = tmp_path / "saved.anchor"
    shutil.copyfile(anchor, saved)
    with open(anchor, "r+b") as f:  # sparse: no disk is used for the hole
        if planted == "zeros":
            f.truncate(0)
        elif planted == "huge_record":  # a signed V record that declares 2 GiB - 1
            f.truncate(0)
            f.write(b"v" + struct.pack("<I", (1 << 31) - 1))
        f.truncate(64 * GIB)
    assert os.stat(anchor).st_blocks * 512 < 64 << 20
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    expected = {
        "zeros": "CorruptFrameError",
        "frame_then_hole": "bytes after its end record",
        "huge_record": "over its cap",
    }[planted]
    refused_once_and_unchanged(receiver, live, expected)
    assert "store file refused" in caplog.text
    os.replace(saved, anchor)  # the store is repaired: the receiver catches up
    assert receiver.run_until(1, timeout=20) and same_state(live, states[1])
    publisher.sink.close()


def test_a_frame_file_that_is_a_link_or_a_fifo_is_refused(tmp_path):
    publisher, states = published(tmp_path)
    anchor = frame_file(tmp_path, 0, "anchor")
    elsewhere = tmp_path / "elsewhere.anchor"
    os.replace(anchor, elsewhere)
    os.symlink(elsewhere, anchor)  # a link to the very same (valid) bytes: still not followed
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    refused_once_and_unchanged(receiver, live, "symbolic link")
    anchor.unlink()
    os.mkfifo(anchor)  # opening a FIFO for reading would block forever
    receiver.refused.clear()
    refused_once_and_unchanged(receiver, live, "not a regular file")
    anchor.unlink()
    os.replace(elsewhere, anchor)
    assert receiver.run_until(1, timeout=20) and same_state(live, states[1])
    # The lease and the pointer are never followed either.
    (tmp_path / "lease").unlink()
    os.symlink(tmp_path / "latest", tmp_path / "lease")
    with pytest.raises(LeaseHeldError):  # the signed pointer (fresh) still shows the store held
        Publisher(DirectoryStore(tmp_path, lease_wait_s=0), config=CONFIG)
    publisher.publish(perturb(states[1], 0.02, seed=9))  # the holder repairs its record
    assert not (tmp_path / "lease").is_symlink()
    publisher.sink.close()


# -- item 5: the signed pointer, frame names, the floor ------------------------------------------


def test_latest_is_signed_and_an_unsigned_or_altered_pointer_is_refused(tmp_path):
    publisher, states = published(tmp_path)
    pointer = json.loads((tmp_path / "latest").read_text())
    assert {"run", "epoch", "version", "kind", "anchor", "at", "sig"} <= set(pointer)
    assert pointer["version"] == 1 and abs(pointer["at"] - time.time()) < 60
    cases = {
        # what a store written before signed pointers holds (and what anyone can write)
        "not signed": {k: v for k, v in pointer.items() if k not in ("at", "sig")},
        "fails its signature": pointer | {"version": 0},
        # a lease record is signed for another purpose: it cannot pass for a pointer
        "fails its signature ": json.loads((tmp_path / "lease").read_text())
        | {"version": 1, "kind": "delta"},
    }
    for why, forged in cases.items():
        (tmp_path / "latest").write_text(json.dumps(forged))
        live: dict = {}
        receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
        refused_once_and_unchanged(receiver, live, why.strip())
    publisher.publish(perturb(states[1], 0.02, seed=5))  # the next publish signs the pointer again
    assert receiver.run_until(2, timeout=20)
    publisher.sink.close()

    plain = tmp_path / "keyless"  # keyless stays keyless: an unsigned pointer, read by keyless readers
    Publisher(DirectoryStore(plain, key=None), config=CONFIG).publish(states[0])
    assert "sig" not in json.loads((plain / "latest").read_text())
    assert Subscriber(DirectoryStore(plain, key=None), copy_into({}), CONFIG).run_until(0, timeout=10)


def test_a_frame_under_another_versions_name_is_refused(tmp_path):
    publisher, states = published(tmp_path, 4)
    # An old signed anchor copied under the name of a (recovery) anchor of the newest version:
    # a cold receiver would start there. Its verified header says v0: refused.
    planted = frame_file(tmp_path, 0, "anchor").with_name(frame_file(tmp_path, 3, "delta").stem + ".anchor")
    shutil.copyfile(frame_file(tmp_path, 0, "anchor"), planted)
    live: dict = {}
    receiver = Subscriber(DirectoryStore(tmp_path), copy_into(live), CONFIG)
    assert receiver.poll(timeout=0.3) is None  # refused, named, nothing applied
    assert len(receiver.refused) == 1 and "not the version its name says" in receiver.refused[0]
    assert receiver.live_version is None and live == {}
    # Round 3: the refused name no longer hides the real anchor below it (it stays planted).
    assert receiver.run_until(3, timeout=20) and same_state(live, states[3])
    assert [t.version for t in receiver.timings] == [0, 1, 2, 3] and len(receiver.refused) == 1
    assert planted.exists()
    publisher.sink.close()


def test_a_receiver_is_never_rolled_back_below_what_it_has_seen_signed(tmp_path):
    states = trajectory(6)
    publisher = Publisher(DirectoryStore(tmp_path, lease_wait_s=0), anchor_every=None, config=CONFIG)
    publisher.publish(states[0])
    old_anchor = frame_file(tmp_path, 0, "anchor").read_bytes()  # a copy of the run's start
    old_pointer = (tmp_path / "latest").read_bytes()  # ... and of its signed pointer
    warm: dict = {}
    follower = Subscriber(DirectoryStore(tmp_path), copy_into(warm), CONFIG)
    for version in range(1, 6):
        publisher.publish(states[version])
    assert follower.run_until(5, timeout=20)
    publisher.sink.close()

    # Whoever can write the store puts the start of the run back: the old signed anchor and
    # pointer, every later frame gone.
    name = frame_file(tmp_path, 0, "anchor").name
    shutil.rmtree(tmp_path / "frames")
    (tmp_path / "frames").mkdir()
    (tmp_path / "frames" / name).write_bytes(old_anchor)
    (tmp_path / "latest").write_bytes(old_pointer)

    # Its own version is a floor: the warm receiver stays at v5.
    assert follower.poll(timeout=0.5) is None and follower.live_version == 5 and same_state(warm, states[5])
    # A floor passed in (e.g. the version a signed pull named), with or without its epoch.
    for floor in ({"floor_version": 5, "floor_epoch": publisher.epoch}, {"floor_version": 5}):
        cold: dict = {}
        receiver = Subscriber(DirectoryStore(tmp_path), copy_into(cold), CONFIG, **floor)
        refused_once_and_unchanged(receiver, cold, "RolledBackError")
        assert "older than this receiver's floor v5" in receiver.refused[0]
    # The receive command takes the floor too: refused, nothing activated, exit 1.
    r = subprocess.run(
        [sys.executable, "-m", "modal_rl.weightsync", "receive", "--store", str(tmp_path), "--until", "5"]
        + ["--floor", "5", "--floor-epoch", str(publisher.epoch), "--timeout", "3", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 1 and "version 5 not live" in r.stderr, r.stderr
    assert [e["event"] for e in events] == ["ready", "refused"] and "RolledBackError" in events[1]["error"]
    # Without a floor, a cold receiver cannot tell this store from the run's start (documented).
    naive: dict = {}
    assert Subscriber(DirectoryStore(tmp_path), copy_into(naive), CONFIG).run_until(0, timeout=10)
    assert same_state(naive, states[0])


def test_a_floor_holds_over_tcp_too():
    """Frames below the floor on the way up to it are staged, never activated; an epoch older
    than the floor's is refused before anything is staged."""
    states = trajectory(3)
    server = FrameServer("127.0.0.1", 0)
    publisher = Publisher(server, anchor_every=None, config=CONFIG)
    for state in states:
        publisher.publish(state)
    activated: list[int] = []
    live: dict = {}

    def activate(staged, version):
        activated.append(version)
        copy_into(live)(staged, version)

    receiver = Subscriber(TcpSource(*server.address), activate, CONFIG, floor_version=2)
    newer = Subscriber(TcpSource(*server.address), copy_into({}), CONFIG, floor_epoch=publisher.epoch + 1)
    try:
        assert receiver.run_until(2, timeout=20)
        assert activated == [2] and same_state(live, states[2])
        assert newer.poll(timeout=5) is None and "RolledBackError" in newer.refused[0]
        assert newer.chain.version is None and newer.chain.state == {}
    finally:
        receiver.source.close()
        newer.source.close()
        server.close()
