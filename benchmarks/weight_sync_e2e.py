"""Suite ``weight-sync-e2e``: one publisher, 1 and 4 receiver processes on loopback.

The publisher's link is rate-limited (a token bucket shared by all its connections, i.e.
its NIC) to 1 and 10 Gbps. Each scenario syncs the same real update trajectory (bf16 sync
points of an Adam run of all-MiniLM-L6-v2, as in ``weight-sync``) twice over the same TCP
transport: as full anchors every version, and as deltas. Time per version runs from
``publish()`` to the moment the last receiver finished activating it. ``pause_s`` is the
longest activation callback (the engine pause); fetch, decode and verify happen before it,
while the engine would keep serving. ``fanout=relay`` chains the receivers (each re-serves
what it receives on its own link) instead of all drawing on the publisher's link.

Every scenario runs twice: with the run key (the default: mutual handshake, every record
signed and verified with HMAC-SHA256) and explicitly keyless, so the cost of
authentication is measured side by side in one run (``delta auth/keyless``,
``full auth/keyless``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._weight_sync_data import adam_trajectory
from benchmarks.report import markdown_table, progress, write_json
from modal_rl.run_key import RUN_KEY_ENV, new_run_key
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.transport import gbps
from modal_rl.weightsync.transport_tcp import FrameServer

SUITE = "weight-sync-e2e"
ROOT = Path(__file__).resolve().parents[1]


class ReceiverProc:
    def __init__(
        self,
        upstream: tuple[str, int],
        until: int,
        out: Path,
        relay_port: int | None,
        link: float,
        keyed: bool,
    ):
        cmd = [
            sys.executable,
            "-m",
            "modal_rl.weightsync",
            "receive",
            "--tcp",
            f"{upstream[0]}:{upstream[1]}",
        ]
        cmd += ["--until", str(until), "--out", str(out), "--timeout", "600", "--threads", "1"]
        if relay_port is not None:
            cmd += ["--relay-port", str(relay_port), "--relay-gbps", str(link)]
        if not keyed:
            cmd.append("--keyless")
        self.out = out
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def activated(self, version: int) -> dict | None:
        return next((e for e in self.events if e["event"] == "activated" and e["version"] == version), None)

    def ready(self) -> bool:
        return any(e["event"] == "ready" for e in self.events)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _free_port() -> int:
    from modal_rl.cluster.ports import reserve

    return reserve(1)[0]


def run_mode(
    states, mode: str, receivers: int, link: float, fanout: str, workdir: Path, keyed: bool = True
) -> dict[str, Any]:
    last = len(states) - 1
    key = os.environ[RUN_KEY_ENV] if keyed else None
    server = FrameServer(key=key, rate_bytes_per_s=gbps(link), max_buffer_bytes=256 << 20, slow_timeout_s=60)
    publisher = Publisher(server, anchor_every=1 if mode == "full" else 10_000, config=CodecConfig(threads=2))
    procs: list[ReceiverProc] = []
    try:
        upstream = server.address
        for i in range(receivers):
            relay_port = _free_port() if fanout == "relay" and i < receivers - 1 else None
            out = workdir / f"{mode}-{i}.safetensors"
            procs.append(ReceiverProc(upstream, last, out, relay_port, link, keyed))
            if relay_port is not None:
                _wait(procs[-1].ready, 120, "relay receiver start")
                time.sleep(0.3)
                upstream = ("127.0.0.1", relay_port)
        _wait(lambda: all(p.ready() for p in procs), 120, "receivers to start")
        _wait(
            lambda: server.receivers >= 1 if fanout == "relay" else server.receivers == receivers,
            60,
            "connects",
        )
        time.sleep(0.5)
        publisher.publish(states[0])  # warm-up: everyone starts from the same anchor
        _wait(lambda: all(p.activated(0) for p in procs), 300, "version 0")
        per_version, sizes, pauses = [], [], []
        for v in range(1, last + 1):
            t0 = time.time()
            report = publisher.publish(states[v])
            _wait(lambda v=v: all(p.activated(v) for p in procs), 300, f"version {v}")
            events = [p.activated(v) for p in procs]
            per_version.append(max(e["activated_at"] for e in events) - t0)
            sizes.append(report.bytes)
            pauses += [e["activate_s"] for e in events]
        _wait(lambda: all(p.proc.poll() is not None for p in procs), 120, "receivers to write their weights")
        exact = all(_same_file(p.out, states[last]) for p in procs)
        return {
            "sync_s": statistics.mean(per_version),
            "bytes": statistics.mean(sizes),
            "pause_s": max(pauses),
            "bit_exact": exact,
        }
    finally:
        for p in procs:
            p.stop()
        server.close()


def _same_file(path: Path, state) -> bool:
    import torch
    from safetensors.torch import load_file

    got = load_file(str(path))
    return set(got) == set(state) and all(
        torch.equal(got[k].view(torch.int16), state[k].view(torch.int16)) for k in state
    )


def run(quick: bool, out: Path) -> dict[str, Any]:
    versions = 3 if quick else 6
    states_by_step = adam_trajectory(1e-6, list(range(versions + 1)))
    states = [states_by_step[i] for i in range(versions + 1)]
    scenarios = [(r, link, "direct") for r in (1, 4) for link in (1, 10)]
    scenarios.append((4, 1, "relay"))
    workdir = out / "weight-sync-e2e-files"
    workdir.mkdir(parents=True, exist_ok=True)
    # The suite is its own launcher: receivers inherit the run key through the environment.
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    rows = []
    for receivers, link, fanout in progress(scenarios, total=len(scenarios), desc=SUITE):
        runs = {}
        # Interleaved, so that load from elsewhere on the host hits both modes alike.
        for mode in ("full", "delta"):
            for keyed in (False, True):
                runs[mode, keyed] = run_mode(states, mode, receivers, link, fanout, workdir, keyed)
        full, delta = runs["full", True], runs["delta", True]
        rows.append(
            {
                "receivers": receivers,
                "link_gbps": link,
                "fanout": fanout,
                "full_s": full["sync_s"],
                "delta_s": delta["sync_s"],
                "full_keyless_s": runs["full", False]["sync_s"],
                "delta_keyless_s": runs["delta", False]["sync_s"],
                "bytes_full": full["bytes"],
                "bytes_delta": delta["bytes"],
                "pause_s": delta["pause_s"],
                "pause_full_s": full["pause_s"],
                "bit_exact": all(r["bit_exact"] for r in runs.values()),
            }
        )
    for p in workdir.iterdir():
        p.unlink()
    workdir.rmdir()
    payload = {"quick": quick, "versions": versions, "scenarios": rows}
    write_json(out, SUITE, payload)
    text = render(rows)
    (out / f"{SUITE}.md").write_text(text)
    plot(rows, out / f"{SUITE}.png")
    print(text)
    return payload


def render(rows: list[dict[str, Any]]) -> str:
    table = markdown_table(
        ["receivers", "link Gbps", "fan-out", "full s", "delta s", "delta/full", "pause s", "pause/full", "bytes full", "bytes delta",
         "full keyless s", "full auth/keyless", "delta keyless s", "delta auth/keyless", "bit-exact"],
        [
            [
                r["receivers"],
                r["link_gbps"],
                r["fanout"],
                r["full_s"],
                r["delta_s"],
                r["delta_s"] / r["full_s"],
                r["pause_s"],
                r["pause_s"] / r["full_s"],
                f"{r['bytes_full']:,.0f}",
                f"{r['bytes_delta']:,.0f}",
                r["full_keyless_s"],
                r["full_s"] / r["full_keyless_s"],
                r["delta_keyless_s"],
                r["delta_s"] / r["delta_keyless_s"],
                r["bit_exact"],
            ]
            for r in rows
        ],
    )  # fmt: skip
    ratios = [(r["full_s"] / r["full_keyless_s"], r["delta_s"] / r["delta_keyless_s"]) for r in rows]
    summary = (
        f"Authentication cost (run key: handshake + HMAC-SHA256 per record, vs keyless), mean over "
        f"scenarios: full anchor {statistics.mean(f for f, _ in ratios):.3f}x, "
        f"delta {statistics.mean(d for _, d in ratios):.3f}x."
    )
    return (
        f"# weight-sync-e2e\n\nSeconds per version, publish() to the last receiver's activation "
        f"(with the run key unless marked keyless).\n\n{table}\n\n{summary}\n"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['receivers']}rx {r['link_gbps']}G {r['fanout']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], [r["full_s"] for r in rows], 0.4, label="full anchors")
    ax.bar([i + 0.2 for i in x], [r["delta_s"] for r in rows], 0.4, label="deltas")
    ax.plot(list(x), [r["pause_s"] for r in rows], "k_", markersize=18, label="engine pause (delta)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
    ax.set_ylabel("seconds per version")
    ax.set_title("Weight sync over TCP, loopback with a rate-limited link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
