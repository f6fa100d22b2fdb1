"""Fault tests with real sockets and processes: killed receivers, damaged streams,
publisher restarts. Every test ends with its processes reaped and its ports closed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync import CodecConfig, VersionChain, encode_anchor, encode_delta, frame_bytes
from modal_rl.weightsync.errors import BaseMismatchError
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.base import FrameSource
from modal_rl.weightsync.transport.tcp import FrameServer
from tests.weightsync_helpers import TEST_KEY, perturb, same_state

ROOT = Path(__file__).resolve().parents[2]
CONFIG = CodecConfig(chunk_elems=1 << 18, threads=2)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    """Keyed, as a launched run is: the frame server, and the receiver processes (which
    inherit the environment), use the run's key."""
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def big_states(n: int, words: int = 2_000_000):
    gen = torch.Generator().manual_seed(0)
    first = {
        "embed": torch.randn(words // 2, generator=gen).to(torch.bfloat16).reshape(-1, 100),
        "mlp": torch.randn(words // 2, generator=gen).to(torch.bfloat16),
        "norm": torch.randn(100, generator=gen).to(torch.bfloat16),
    }
    states = [first]
    for i in range(1, n):
        states.append(perturb(states[-1], 0.02, seed=i))
    return states


class Receiver:
    """A real receiver process (``python -m modal_rl.weightsync receive``)."""

    def __init__(self, address, until: int, out: Path, timeout: float = 120) -> None:
        host, port = address
        cmd = [sys.executable, "-m", "modal_rl.weightsync", "receive", "--tcp", f"{host}:{port}"]
        cmd += ["--until", str(until), "--out", str(out), "--timeout", str(timeout)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def wait_for(self, event: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events:
                if e["event"] == event:
                    return e
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no {event!r} event; events={self.events} stderr={self.proc.stderr.read()}")

    def finish(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.reader.join(5)


def port_is_free(port: int) -> bool:
    """Nothing listens there any more (TIME_WAIT leftovers of closed connections are fine)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_receiver_killed_mid_stream_restarts_and_ends_bit_identical(tmp_path):
    states = big_states(3)
    # ~4 MB anchor over a 16 MB/s link: the kill lands while the anchor is on the wire.
    server = FrameServer(rate_bytes_per_s=16e6)
    publisher = Publisher(server, anchor_every=100, config=CONFIG)
    first = Receiver(server.address, until=2, out=tmp_path / "first.safetensors")
    try:
        first.wait_for("ready")
        time.sleep(0.5)  # connected and waiting
        sender = threading.Thread(target=publisher.publish, args=(states[0],))
        sender.start()
        time.sleep(0.1)
        first.kill()
        assert not [e for e in first.events if e["event"] == "activated"], "killed too late"
        sender.join(60)
        publisher.publish(states[1])
        publisher.publish(states[2])
        second = Receiver(server.address, until=2, out=tmp_path / "second.safetensors")
        assert second.finish() == 0
        kinds = [e["kind"] for e in second.events if e["event"] == "activated"]
        assert kinds == ["anchor", "delta", "delta"]  # caught up from the last anchor
        assert same_state(load_file(tmp_path / "second.safetensors"), dict(sorted(states[2].items())))
    finally:
        first.kill()
        port = server.address[1]
        server.close()
    assert port_is_free(port)


class FlakyProxy:
    """A TCP proxy between receiver and server that damages its first connection's
    server→receiver stream (one flipped bit, or a cut), then behaves."""

    def __init__(self, upstream, damage: str, at_byte: int) -> None:
        self.upstream, self.damage, self.at = upstream, damage, at_byte
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.connections = 0
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            first = self.connections == 0
            self.connections += 1
            for src, dst, damaged in ((client, server, False), (server, client, first)):
                t = threading.Thread(target=self._pump, args=(src, dst, damaged), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src, dst, damaged: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if damaged and seen <= self.at < seen + len(data):
                    if self.damage == "cut":
                        dst.sendall(data[: self.at - seen])
                        break
                    data = bytearray(data)
                    data[self.at - seen] ^= 0x04
                    data = bytes(data)
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_damaged_stream_is_refused_and_the_receiver_recovers(tmp_path, damage):
    states = big_states(3, words=200_000)
    server = FrameServer()
    publisher = Publisher(server, anchor_every=100, config=CONFIG)
    for state in states:
        publisher.publish(state)
    anchor_size = server.retained[0].size  # bytes, as the stream carries them
    proxy = FlakyProxy(server.address, damage, at_byte=anchor_size + 200)  # inside the first delta
    receiver = Receiver(proxy.address, until=2, out=tmp_path / "out.safetensors")
    try:
        assert receiver.finish() == 0
        events = [e["event"] for e in receiver.events]
        if damage == "flip":
            assert "refused" in events  # a flipped bit inside a record fails its digest
        assert proxy.connections >= 2  # it reconnected and asked for what it lacked
        assert same_state(load_file(tmp_path / "out.safetensors"), dict(sorted(states[2].items())))
    finally:
        receiver.kill()
        proxy.close()
        server.close()


def test_publisher_restart_resumes_the_chain(tmp_path):
    states = big_states(4, words=200_000)
    server = FrameServer()
    port = server.address[1]
    publisher = Publisher(server, anchor_every=100, config=CONFIG)
    receiver = Receiver(("127.0.0.1", port), until=3, out=tmp_path / "out.safetensors")
    try:
        publisher.publish(states[0])
        publisher.publish(states[1])
        deadline = time.monotonic() + 60
        while not any(e.get("version") == 1 for e in receiver.events if e["event"] == "activated"):
            assert time.monotonic() < deadline, receiver.events
            time.sleep(0.05)
        server.close()  # the trainer process goes away...
        restarted = FrameServer(port=port)  # ...and comes back on the same address
        publisher = Publisher(restarted, anchor_every=100, config=CONFIG)
        publisher.publish(states[2], version=2)  # a new publisher starts with an anchor
        publisher.publish(states[3], version=3)
        assert receiver.finish() == 0
        kinds = [(e["version"], e["kind"]) for e in receiver.events if e["event"] == "activated"]
        assert kinds == [(0, "anchor"), (1, "delta"), (2, "anchor"), (3, "delta")]
        assert same_state(load_file(tmp_path / "out.safetensors"), dict(sorted(states[3].items())))
    finally:
        receiver.kill()
        server.close()
        if "restarted" in locals():
            restarted.close()
    assert port_is_free(port)


class ListSource(FrameSource):
    keys = None  # explicitly keyless: the frames below are unsigned codec output

    def __init__(self, frames):
        self.frames = list(frames)

    def next_frame(self, have_version, timeout=None, epoch=None, floor=None):
        return self.frames.pop(0) if self.frames else None

    def close(self):
        pass


def test_out_of_order_and_stale_frames_leave_live_weights_untouched():
    states = big_states(3, words=50_000)
    anchor = frame_bytes(encode_anchor(states[0], version=0, config=CONFIG))
    d1 = frame_bytes(encode_delta(states[0], states[1], base_version=0, version=1, config=CONFIG))
    d2 = frame_bytes(encode_delta(states[1], states[2], base_version=1, version=2, config=CONFIG))
    live: dict = {}
    sub = Subscriber(ListSource([anchor, d2, d1, d1, d2]), copy_into(live), CONFIG)
    assert sub.poll().version == 0
    assert sub.poll() is None and "BaseMismatchError" in sub.refused[-1]  # d2 before d1
    assert same_state(live, states[0]) and sub.chain.version == 0
    assert sub.poll().version == 1
    assert sub.poll() is None and "StaleVersionError" in sub.refused[-1]  # d1 replayed
    assert sub.poll().version == 2 and same_state(live, states[2])
    with pytest.raises(BaseMismatchError):
        VersionChain(CONFIG, key=None).apply(d1)


def test_no_stray_children_left():
    # Every Receiver above was waited for; nothing of ours is still running.
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(os.getpid())], capture_output=True, text=True
    )
    pids = [int(p) for p in children.stdout.split()]
    alive = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"modal_rl.weightsync" in cmd:
            alive.append(pid)
    assert alive == []
