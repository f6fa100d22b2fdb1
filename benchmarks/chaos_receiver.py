"""Chaos scenario (b): a weight receiver SIGKILLed in the middle of an anchor.

A trainer-side ``Publisher`` on a ``FrameServer`` (rate-limited to a modest link, so an anchor
takes about a second on the wire) publishes an anchor and then deltas; receivers are real
``python -m modal_rl.weightsync receive`` processes, keyed with the run key as a launched run
is. Reference: one receiver takes every version undisturbed (this also measures one anchor
transfer, publish -> activated). Disturbed: the receiver is SIGKILLed while the anchor is on
the wire (it must not have activated anything), the trainer keeps publishing, and a
replacement receiver is started at once, as an engine supervisor would.

Reported: recovery time (kill -> the replacement holds the newest version), the anchor
transfer for comparison, whether the replacement's weights equal the publisher's newest
state bit for bit, and receiver processes / listening ports left. ``steps_lost`` is 0 when
the trainer never stopped publishing; there are no rollout samples in this scenario, so
``wrong_version_samples`` is null and ``details.partial_activations`` counts activations of
a version the killed receiver had not fully verified (must be 0).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Receiver:
    def __init__(self, address, until: int, out: Path, timeout: float = 300) -> None:
        host, port = address
        cmd = [sys.executable, "-m", "modal_rl.weightsync", "receive", "--tcp", f"{host}:{port}"]
        cmd += ["--until", str(until), "--out", str(out), "--timeout", str(timeout)]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[tuple[float, dict]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append((time.monotonic(), json.loads(line)))

    def first(self, event: str, timeout: float = 300, **match) -> tuple[float, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, e in list(self.events):
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return t, e
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.01)
        raise RuntimeError(f"receiver: no {event!r} event; stderr: {self.proc.stderr.read()[-2000:]}")

    def activated(self) -> list[dict]:
        return [e for _, e in self.events if e.get("event") == "activated"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.reader.join(5)


def states(count: int, words: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    first = {
        "embed": torch.randn(words // 2, generator=gen).to(torch.bfloat16).reshape(-1, 100),
        "mlp": torch.randn(words // 2, generator=gen).to(torch.bfloat16),
        "norm": torch.randn(100, generator=gen).to(torch.bfloat16),
    }
    out = [first]
    for i in range(1, count):
        nxt = {}
        g = torch.Generator().manual_seed(i)
        for name, t in out[-1].items():
            flat = t.clone().reshape(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
            flat[idx] = (flat[idx].float() + 0.01 * torch.randn(idx.numel(), generator=g)).to(t.dtype)
            nxt[name] = flat.reshape(t.shape)
        out.append(nxt)
    return out


def _same(a: dict, b: dict) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a
    )


def _port_free(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def _pass(seq, *, kill: bool, out_dir: Path, rate: float) -> dict:
    from safetensors.torch import load_file

    from modal_rl.weightsync import CodecConfig
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.transport.tcp import FrameServer

    last = len(seq) - 1
    server = FrameServer(rate_bytes_per_s=rate)
    publisher = Publisher(server, anchor_every=100, config=CodecConfig(chunk_elems=1 << 18, threads=2))
    first = _Receiver(server.address, until=last, out=out_dir / "first.safetensors")
    receivers, result = [first], {}
    try:
        first.first("ready")
        time.sleep(0.3)  # connected and waiting for frames
        sender = threading.Thread(target=publisher.publish, args=(seq[0],))
        published = time.monotonic()
        sender.start()
        if kill:
            time.sleep(0.25)  # the anchor is on the wire
            killed_at = time.monotonic()
            first.kill()
            result["partial_activations"] = len(first.activated())
            replacement = _Receiver(server.address, until=last, out=out_dir / "second.safetensors")
            receivers.append(replacement)
        sender.join(300)
        result["anchor_send_s"] = time.monotonic() - published
        for state in seq[1:]:
            publisher.publish(state)
        final = receivers[-1]
        t_last, _ = final.first("activated", version=last)
        if kill:
            result["recovery_s"] = t_last - killed_at
        else:
            t_anchor, _ = final.first("activated", version=0)
            result["anchor_transfer_s"] = t_anchor - published
        if kill:
            t_ready, _ = final.first("ready")
            result["receiver_start_s"] = t_ready - final.started
        final.proc.wait(120)
        final.reader.join(5)
        result["exit_code"] = final.proc.returncode
        result["kinds"] = [e.get("kind") for e in final.activated()]
        result["weights_match"] = _same(load_file(out_dir / Path(final.proc.args[-3]).name), seq[-1])
    finally:
        for r in receivers:
            r.kill()
        port = server.address[1]
        server.close()
    result["leaked"] = [r.proc.pid for r in receivers if r.proc.poll() is None] + (
        [] if _port_free(port) else [f"port {port}"]
    )
    return result


def run_scenario(quick: bool, say=print) -> dict:
    from modal_rl.run_key import ensure_run_key

    ensure_run_key()  # server and receivers (inheriting the env) share the run's key
    words, versions, rate = (4_000_000, 4, 8e6) if quick else (16_000_000, 8, 32e6)
    seq = states(versions, words)
    with tempfile.TemporaryDirectory(prefix="chaos-b-") as tmp:
        say(f"(b) receiver: reference, {words * 2 / 1e6:.0f} MB anchor over a {rate / 1e6:.0f} MB/s link")
        ref = _pass(seq, kill=False, out_dir=Path(tmp), rate=rate)
        say("(b) receiver: SIGKILL the receiver while the anchor is on the wire; restart it")
        dis = _pass(seq, kill=True, out_dir=Path(tmp), rate=rate)
    say(
        f"(b) receiver: recovered in {dis['recovery_s']:.2f} s (one anchor: {ref['anchor_transfer_s']:.2f} s)"
    )
    return {
        "name": "b_receiver_kill_mid_anchor",
        "completed": dis["exit_code"] == 0 and dis["weights_match"],
        "steps_lost": 0,
        "steps_since_checkpoint": None,
        "wrong_version_samples": None,
        "recovery_s": round(dis["recovery_s"], 3),
        "engine_cold_start_s": None,
        "anchor_transfer_s": round(ref["anchor_transfer_s"], 3),
        "leaked_processes": len(ref["leaked"]) + len(dis["leaked"]),
        "leaked_sandboxes": None,
        "final_weights_match": bool(dis["weights_match"] and ref["weights_match"]),
        "details": {
            "partial_activations": dis["partial_activations"],
            "replacement_start_s": round(dis["receiver_start_s"], 3),
            "replacement_activated": dis["kinds"],
            "anchor_mb": words * 2 / 1e6,
            "link_mb_per_s": rate / 1e6,
            "versions": versions,
        },
    }
