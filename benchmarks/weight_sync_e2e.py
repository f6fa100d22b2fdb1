"""Suite ``weight-sync-e2e``: one publisher, 1 and 4 receiver processes on loopback.

The publisher's link is rate-limited (a token bucket shared by all its connections, i.e.
its NIC) to 1, 10 and 25 Gbps. Each scenario syncs the same real update trajectory (bf16
sync points of an Adam run of all-MiniLM-L6-v2, as in ``weight-sync``) over the same TCP
transport and receiver processes, once per coding: full anchors every version (``full``),
our deltas as the publisher codes them for the link (``delta``: v2 chunks only where the
bytes they save on this link outweigh their decode time), v1 coding only (``v1``), and
slime's xor + zstd-1 carried in our frames (``slime``: every chunk a dense XOR with zstd
planes). Time per version runs from ``publish()`` to the moment the last receiver
finished activating it; ``first_delta_s`` is the first delta of fresh receivers (they
load the codec's kernels before they report ready), the steady time the mean of the rest.
``pause_s`` is the longest activation callback (the engine pause). ``fanout=relay`` chains
the receivers (each re-serves what it receives on its own link) instead of all drawing on
the publisher's link. Receivers decode each record as it arrives (``TcpSource.next_records``),
so encode, wire and decode overlap.

The model-scale scenarios tile the real trajectory's tensors to a multi-GB bf16 state
(``state_gb``; every tile has the real per-tensor change statistics) and run through the
same transport and receivers (which keep no second live copy there, to fit the host's
memory; every tensor is still verified against its checksum); they add a ``v2`` run (v2
wherever it is smaller, whatever the link) for the bytes.

Every small scenario also runs full and delta keyless, so the cost of authentication is
measured side by side in one run (``delta auth/keyless``, ``full auth/keyless``). Its parts
are timed beside every scenario's steady delta (``_weight_sync_crypto``): the record MACs over
the delta's bytes, and the trainer's one Ed25519 signature per version and its check.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._weight_sync_crypto import crypto_costs
from benchmarks._weight_sync_data import adam_trajectory, tiled_size, tiled_state
from benchmarks.report import markdown_table, progress, write_json
from modal_rl.run_key import RUN_KEY_ENV, new_run_key
from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.transport.base import gbps
from modal_rl.weightsync.transport.tcp import FrameServer

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
        self.out = out
        cmd = [
            sys.executable,
            "-m",
            "modal_rl.weightsync",
            "receive",
            "--tcp",
            f"{upstream[0]}:{upstream[1]}",
        ]
        cmd += ["--until", str(until), "--timeout", "900", "--threads", "1"]
        cmd += ["--no-live-copy"] if out is None else ["--out", str(out)]
        if relay_port is not None:
            cmd += ["--relay-port", str(relay_port), "--relay-gbps", str(link)]
        if not keyed:
            cmd.append("--keyless")
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


MODES = {  # mode: (anchor_every, codec config)
    "full": (1, CodecConfig(threads=2)),
    "delta": (10_000, CodecConfig(threads=2)),  # coded for the link (the server's rate)
    "v1": (10_000, CodecConfig(threads=2, coding=1)),
    "slime": (10_000, CodecConfig(threads=2, coding=0)),
    # v2 wherever smaller: a link this slow makes every byte worth more than any decode time
    "v2": (10_000, CodecConfig(threads=2, link_bytes_per_s=1.0)),
}


def run_mode(
    states, mode: str, receivers: int, link: float, fanout: str, workdir: Path, keyed: bool = True
) -> dict[str, Any]:
    """``states``: per version a state dict, or a callable that yields its (name, tensor)
    pairs (model scale: then receivers keep no live copy and write no file)."""
    last = len(states) - 1
    key = os.environ[RUN_KEY_ENV] if keyed else None
    server = FrameServer(key=key, rate_bytes_per_s=gbps(link), max_buffer_bytes=256 << 20, slow_timeout_s=120)
    anchor_every, config = MODES[mode]
    publisher = Publisher(server, anchor_every=anchor_every, config=config)
    streamed = callable(states[0])
    procs: list[ReceiverProc] = []
    try:
        upstream = server.address
        for i in range(receivers):
            relay_port = _free_port() if fanout == "relay" and i < receivers - 1 else None
            out = None if streamed else workdir / f"{mode}-{i}.safetensors"
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
        publish = lambda v: publisher.publish(states[v]() if streamed else states[v])  # noqa: E731
        publish(0)  # warm-up: everyone starts from the same anchor
        _wait(lambda: all(p.activated(0) for p in procs), 900, "version 0")
        per_version, sizes, pauses = [], [], []
        for v in range(1, last + 1):
            t0 = time.time()
            report = publish(v)
            _wait(lambda v=v: all(p.activated(v) for p in procs), 900, f"version {v}")
            events = [p.activated(v) for p in procs]
            per_version.append(max(e["activated_at"] for e in events) - t0)
            sizes.append(report.bytes)
            pauses += [e["activate_s"] for e in events]
        _wait(lambda: all(p.proc.poll() is not None for p in procs), 300, "receivers to write their weights")
        # streamed: every activation is a verified one (each tensor's ls128 sum matched)
        exact = streamed or all(_same_file(p.out, states[last]) for p in procs)
        return {
            "sync_s": statistics.mean(per_version),
            "per_version_s": per_version,
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


def _crypto(row: dict[str, Any]) -> dict[str, Any]:
    """The MAC and signature costs of one of ``row``'s steady delta versions, beside it."""
    costs = crypto_costs(row["bytes_delta"], row["receivers"])
    steady = row["delta_steady_s"]
    return costs | {
        "mac_over_steady": costs["mac_s"] / steady,
        "sig_over_steady": costs["signature_s"] / steady,
    }


def _row(receivers: int, link: float, fanout: str, runs: dict) -> dict[str, Any]:
    delta = runs["delta", True]
    row = {
        "receivers": receivers,
        "link_gbps": link,
        "fanout": fanout,
        "full_s": runs["full", True]["sync_s"],
        "delta_s": delta["sync_s"],
        "first_delta_s": delta["per_version_s"][0],
        "delta_steady_s": statistics.mean(delta["per_version_s"][1:] or delta["per_version_s"]),
        "delta_per_version_s": delta["per_version_s"],
        "bytes_full": runs["full", True]["bytes"],
        "bytes_delta": delta["bytes"],
        "pause_s": delta["pause_s"],
        "pause_full_s": runs["full", True]["pause_s"],
        "bit_exact": all(r["bit_exact"] for r in runs.values()),
    }
    for mode in ("v1", "slime", "v2"):
        if (mode, True) in runs:
            row[f"{mode}_s"] = runs[mode, True]["sync_s"]
            row[f"bytes_{mode}"] = runs[mode, True]["bytes"]
            row[f"{mode}_per_version_s"] = runs[mode, True]["per_version_s"]
    if ("delta", False) in runs:
        row["full_keyless_s"] = runs["full", False]["sync_s"]
        row["delta_keyless_s"] = runs["delta", False]["sync_s"]
    return row


def _slime_bytes(states) -> float:
    """slime's own xor + zstd-1 bytes per version (per-tensor XOR, zstd level 1), for the ratio."""
    from benchmarks._weight_sync_codecs import make_codecs

    xor = next(c for c in make_codecs(2) if c.name == "slime_xor_zstd")
    return statistics.mean(
        xor.size(xor.encode(states[v - 1], states[v], None)) for v in range(1, len(states))
    )


# Run order per scenario. A full-anchor run leaves the host busy as it ends (receivers
# writing their weights, a model's worth of buffers freed), and the mode after it paid for
# that: at 2 GB its first delta took 1.9 s against 1.65 s for the next ones (it was always
# ``delta``). So the sparse modes run first (slime's right after the previous scenario's
# full run), the full runs last, v1 and delta each after a sparse mode, and every mode
# starts on a settled host (``_settled``).
SMALL_ORDER = (
    ("slime", True),
    ("v1", True),
    ("delta", True),
    ("delta", False),
    ("full", False),
    ("full", True),
)
SCALE_ORDER = ("slime", "v1", "delta", "v2", "full")
SETTLE_S = 1.0


def _settled(fn, *args):
    """``fn(*args)`` once the previous mode's garbage is collected and its processes are gone."""
    gc.collect()
    time.sleep(SETTLE_S)
    return fn(*args)


def run(quick: bool, out: Path) -> dict[str, Any]:
    versions = 5 if quick else 8
    states_by_step = adam_trajectory(1e-6, list(range(versions + 1)))
    states = [states_by_step[i] for i in range(versions + 1)]
    scenarios = [(r, link, "direct") for r in (1, 4) for link in (1, 10, 25)]
    scenarios.append((4, 1, "relay"))
    workdir = out / "weight-sync-e2e-files"
    workdir.mkdir(parents=True, exist_ok=True)
    # The suite is its own launcher: receivers inherit the run key through the environment.
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    slime_bytes = _slime_bytes(states)
    rows = []
    for receivers, link, fanout in progress(scenarios, total=len(scenarios), desc=SUITE):
        runs = {}
        for mode, keyed in SMALL_ORDER:
            runs[mode, keyed] = _settled(run_mode, states, mode, receivers, link, fanout, workdir, keyed)
        row = _row(receivers, link, fanout, runs)
        rows.append(row | _crypto(row) | {"state_gb": _gb(states[0]), "bytes_slime_own": slime_bytes})
    # Model scale: (receivers, GB); 4 receivers at a smaller state so that all copies fit
    # the host's memory (each receiver holds its own and, for an anchor, the next; the
    # publisher two, plus the retained anchor).
    scale = [(1, 2.0), (4, 0.5)] if quick else [(1, 3.0), (4, 0.75)]
    scale_versions = 3 if quick else 4
    for receivers, gb in scale:
        tiles = tiled_size(states[0], gb)
        big = [tiled_state(states[v], tiles) for v in range(scale_versions + 1)]
        runs = {}
        for mode in SCALE_ORDER:
            runs[mode, True] = _settled(run_mode, big, mode, receivers, 1, "direct", workdir)
        own = tiles * _slime_bytes(states[: scale_versions + 1])
        peaks = {  # max resident set so far (KB on Linux): this process, and any receiver
            "peak_rss_gb_publisher_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            "peak_rss_gb_receiver": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6,
        }
        row = _row(receivers, 1, "direct", runs)
        rows.append(
            row
            | _crypto(row)
            | {"state_gb": tiles * _gb(states[0]), "bytes_slime_own": own, "tiles": tiles}
            | peaks
        )
    for p in workdir.iterdir():
        p.unlink()
    workdir.rmdir()
    payload = {"quick": quick, "versions": versions, "scale_versions": scale_versions, "scenarios": rows}
    write_json(out, SUITE, payload)
    text = render(rows)
    (out / f"{SUITE}.md").write_text(text)
    plot(rows, out / f"{SUITE}.png")
    print(text)
    return payload


def _gb(state) -> float:
    return sum(t.numel() * t.element_size() for t in state.values()) / 1e9


def _best_other(r: dict[str, Any]) -> float:
    return min(r["full_s"], r["v1_s"], r["slime_s"])


def render(rows: list[dict[str, Any]]) -> str:
    table = markdown_table(
        [
            "receivers",
            "link Gbps",
            "fan-out",
            "state GB",
            "full s",
            "slime s",
            "v1 s",
            "delta s",
            "delta / best other",
            "delta/full",
            "first delta s",
            "steady delta s",
            "first/steady",
            "delta per version s",
            "bytes delta",
            "delta/slime bytes",
            "slime frame/slime bytes",
            "v2 s",
            "v2/slime bytes",
            "pause s",
            "bit-exact",
        ],
        [
            [
                r["receivers"],
                r["link_gbps"],
                r["fanout"],
                f"{r['state_gb']:.3g}",
                r["full_s"],
                r["slime_s"],
                r["v1_s"],
                r["delta_s"],
                r["delta_s"] / _best_other(r),
                r["delta_s"] / r["full_s"],
                r["first_delta_s"],
                r["delta_steady_s"],
                r["first_delta_s"] / r["delta_steady_s"],
                " ".join(f"{t:.3g}" for t in r["delta_per_version_s"]),
                f"{r['bytes_delta']:,.0f}",
                r["bytes_delta"] / r["bytes_slime_own"],
                r["bytes_slime"] / r["bytes_slime_own"],
                r.get("v2_s", "-"),
                r["bytes_v2"] / r["bytes_slime_own"] if "bytes_v2" in r else "-",
                r["pause_s"],
                r["bit_exact"],
            ]
            for r in rows
        ],
    )
    keyed = [r for r in rows if "delta_keyless_s" in r]
    auth = markdown_table(
        [
            "receivers",
            "link Gbps",
            "fan-out",
            "full keyless s",
            "full auth/keyless",
            "delta keyless s",
            "delta auth/keyless",
        ],
        [
            [
                r["receivers"],
                r["link_gbps"],
                r["fanout"],
                r["full_keyless_s"],
                r["full_s"] / r["full_keyless_s"],
                r["delta_keyless_s"],
                r["delta_s"] / r["delta_keyless_s"],
            ]
            for r in keyed
        ],
    )
    crypto = markdown_table(
        [
            "receivers",
            "fan-out",
            "state GB",
            "steady delta s",
            "bytes delta",
            "MAC s (one side)",
            "MAC/steady",
            "sign s",
            "verify s",
            "sign+verify/steady",
            "sign+verifies CPU s",
        ],
        [
            [
                r["receivers"],
                r["fanout"],
                f"{r['state_gb']:.3g}",
                r["delta_steady_s"],
                f"{r['bytes_delta']:,.0f}",
                r["mac_s"],
                r["mac_over_steady"],
                r["sign_s"],
                r["verify_s"],
                r["sig_over_steady"],
                r["signature_cpu_s"],
            ]
            for r in rows
            if "mac_s" in r
        ],
    )
    ratios = [(r["full_s"] / r["full_keyless_s"], r["delta_s"] / r["delta_keyless_s"]) for r in keyed]
    summary = (
        f"Authentication cost (run key: handshake, HMAC-SHA256 per record and the trainer's Ed25519 "
        f"signature per version, vs keyless), mean over scenarios: full anchor "
        f"{statistics.mean(f for f, _ in ratios):.3f}x, delta {statistics.mean(d for _, d in ratios):.3f}x."
    )
    sig_worst = max((r["sig_over_steady"] for r in rows if "mac_s" in r), default=0.0)
    summary += (
        f"\n\nPer steady delta version, timed on this host beside the run: the trainer's signature and "
        f"one receiver's check add at most {100 * sig_worst:.3f}% of the version's time (size-independent);"
        f" the record MACs, one side, {100 * max((r['mac_over_steady'] for r in rows if 'mac_s' in r), default=0.0):.2f}%"
        f" at most.\n\n{crypto}"
    )
    return (
        f"# weight-sync-e2e\n\nSeconds per version, publish() to the last receiver's activation "
        f"(with the run key unless marked keyless). Bytes are per version; `slime bytes` are slime's "
        f"own xor + zstd-1 bytes of the same versions.\n\n{table}\n\n{auth}\n\n{summary}\n"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['receivers']}rx {r['link_gbps']}G {r['fanout']} {r['state_gb']:.2g}GB" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    bars = [("full_s", "full anchors"), ("slime_s", "slime xor+zstd-1"), ("v1_s", "v1"), ("delta_s", "ours")]
    for k, (col, label) in enumerate(bars):
        ax.bar([i - 0.3 + 0.2 * k for i in x], [r[col] for r in rows], 0.2, label=label)
    ax.plot(list(x), [r["pause_s"] for r in rows], "k_", markersize=18, label="engine pause (delta)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
    ax.set_ylabel("seconds per version")
    ax.set_title("Weight sync over TCP, loopback with a rate-limited link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
