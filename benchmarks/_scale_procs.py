"""The processes of ``weight-sync-scale``: a trainer rank and a sharded receiver.

``python -m benchmarks._scale_procs rank RANK WORLD TRAJ_DIR TILES``
    Holds the real trajectory's small per-version states (``TRAJ_DIR/v{n}.pt``; the tiled
    model-scale state is views of them, as ``tiled_state`` makes it; with ``SCALE_SHAPE=moe``
    cut into 32x64 expert matrices, ``expert_split``) and publishes, for each
    ``publish V`` line on stdin, its dim-0 shard of version V (``dim0_pieces``) through its
    own frame server (``keep_anchors=0``), unthrottled until a ``rate BYTES_PER_S`` line sets
    its share of the receivers' link. Prints one JSON line per event.
``python -m benchmarks._scale_procs rank RANK WORLD TRAJ_DIR TILES gloo:PORT:SIZE``
    The same over a ``torch.distributed`` gloo group of SIZE processes on 127.0.0.1 (the
    ranks first, then the receivers): a ``CollectiveSink`` per rank, one group per rank
    (itself and every receiver); no rate limit (a collective runs at its fabric's pace).
``python -m benchmarks._scale_procs receive ADDRS VERSIONS TRAJ_DIR TILES``
    A ``ShardedReceiver`` over every rank's server (comma-separated host:port) that keeps no
    live copy (what it holds is what it serves); prints one JSON line per activated version
    and, at the end, whether every piece equals the trajectory's last version bit for bit
    (checked after its peak memory is reported: the check loads one small state).
    ``ADDRS`` = ``gloo:PORT:SIZE:RANKS:ME``: a ``CollectiveSource`` per rank instead, as member
    ``ME`` of the group.

Memory is reported as peak RSS (``VmHWM``) and the baseline before the weight-sync
objects were made, so ``peak - baseline`` is what weight sync holds; ``fixed_gb`` is what
it holds before any version (the codec's compiled kernels and libraries, loaded by the
warm-up, and the server): a cost that does not grow with the state.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _rss_gb(field: str = "VmHWM") -> float:
    """Peak (``VmHWM``) or current (``VmRSS``) resident set of this process, in GB. Not
    ``ru_maxrss``: that survives ``exec`` and would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e6  # kB
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _pin_and_options() -> int | None:
    """Pin this process to the core named by ``SCALE_PIN_CPU`` (the pinned rows: one rank on
    core 0, one receiver on core 1); returns ``SCALE_ANCHOR_EVERY`` (None: only the first
    version is an anchor)."""
    import os

    if os.environ.get("SCALE_PIN_CPU"):
        os.sched_setaffinity(0, {int(os.environ["SCALE_PIN_CPU"])})
    every = os.environ.get("SCALE_ANCHOR_EVERY")
    return int(every) if every else None


def _model(state, tiles: int):
    """The model-scale state as (name, tensor) pairs: ``tiles`` copies of ``state``, cut into
    expert matrices where ``SCALE_SHAPE`` is ``moe`` (``expert_split``)."""
    import os

    from benchmarks._weight_sync_data import expert_split, tiled_state

    pairs = tiled_state(state, tiles)()
    return expert_split(pairs) if os.environ.get("SCALE_SHAPE") == "moe" else pairs


def _say(**event) -> None:
    print(json.dumps(event), flush=True)


def _collective_groups(port: str, size: str, ranks: int, me: int) -> list:
    """Join the gloo group on 127.0.0.1; one subgroup per publishing rank (it and every
    receiver), made in the same order by every member."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=me,
        world_size=int(size),
        timeout=timedelta(seconds=900),
    )
    receivers = list(range(ranks, int(size)))
    return [dist.new_group([r, *receivers]) for r in range(ranks)]


def rank_main(rank: int, world: int, traj: Path, tiles: int, transport: str = "tcp") -> None:
    import torch

    from modal_rl.ratelimit import TokenBucket
    from modal_rl.weightsync import CodecConfig
    from modal_rl.weightsync.codec.warmup import wait_warm
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.shards import dim0_pieces
    from modal_rl.weightsync.transport.tcp import LINK_BURST_BYTES, FrameServer

    anchor_every = _pin_and_options()
    states = {int(p.stem[1:]): torch.load(p) for p in sorted(traj.glob("v*.pt"))}
    baseline = _rss_gb()
    if transport.startswith("gloo:"):
        from modal_rl.weightsync.transport.collective import CollectiveSink

        _, port, size = transport.split(":")
        server = CollectiveSink(_collective_groups(port, size, world, rank)[rank], src=rank)
    else:
        server = FrameServer(keep_anchors=0)
    publisher = Publisher(
        server, anchor_every=anchor_every, config=CodecConfig(threads=2), epoch=0x5CA1E, audit_every_s=None
    )
    wait_warm(300)
    fixed = _rss_gb("VmRSS") - baseline
    port = server.address[1] if isinstance(server, FrameServer) else None
    _say(event="ready", rank=rank, port=port, baseline_gb=baseline, fixed_gb=fixed)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "receivers":  # wait until that many receivers are admitted (a group: all are)
            while port is not None and server.receivers < int(arg):
                time.sleep(0.01)
            _say(event="admitted", rank=rank)
            continue
        if cmd == "rate":  # the link changes between versions: the bucket is swapped whole
            if port is not None:
                server.limiter = TokenBucket(float(arg), burst=LINK_BURST_BYTES)
            continue
        version = int(arg)
        # the trainer's pieces (views of its tensors) exist before its publisher is called
        pieces = dict(dim0_pieces(_model(states[version], tiles), rank, world))
        t0, cpu0 = time.perf_counter(), time.process_time()
        report = publisher.publish(pieces, version)
        cpu = time.process_time() - cpu0  # every thread of the process: the codec's work
        shard = sum(t.numel() * t.element_size() for t in publisher.snapshot.values())
        _say(
            event="published",
            rank=rank,
            version=version,
            kind=report.kind,
            seconds=time.perf_counter() - t0,
            bytes=report.bytes,
            shard_gb=shard / 1e9,
            tensors=len(publisher.snapshot),
            peak_rss_gb=_rss_gb(),
            cpu_s=cpu,
        )
    server.close()


def receive_main(addrs: str, versions: int, traj: Path, tiles: int) -> None:
    import torch

    from modal_rl.weightsync import CodecConfig
    from modal_rl.weightsync.codec.warmup import wait_warm
    from modal_rl.weightsync.shards import ShardedReceiver, parse_piece
    from modal_rl.weightsync.transport.tcp import TcpSource

    _pin_and_options()
    baseline = _rss_gb()
    if addrs.startswith("gloo:"):
        from modal_rl.weightsync.transport.collective import CollectiveSource

        _, port, size, ranks, me = addrs.split(":")
        groups = _collective_groups(port, size, int(ranks), int(me))
        sources = [CollectiveSource(group, src=r) for r, group in enumerate(groups)]
    else:
        sources = [TcpSource(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addrs.split(",")]
    receiver = ShardedReceiver(sources, lambda _pieces, _layout, _version: None, CodecConfig(threads=2))
    wait_warm(300)
    _say(event="ready", baseline_gb=baseline, fixed_gb=_rss_gb("VmRSS") - baseline)
    for version in range(versions + 1):
        cpu0 = time.process_time()
        if not receiver.run_until(version, timeout=900):
            _say(event="failed", version=version, staged=receiver.staged())
            return
        # the version's time and CPU end here: what follows is the benchmark's bookkeeping
        done_at, cpu = time.monotonic(), time.process_time() - cpu0
        last = [s.timings[-1] for s in receiver.subscribers]
        held = sum(t.numel() * t.element_size() for s in receiver.subscribers for t in s.chain.state.values())
        _say(
            event="activated",
            version=version,
            fetch_s=max(t.fetch_s for t in last),
            decode_s=max(t.decode_s for t in last),
            verify_s=max(t.verify_s for t in last),
            apply_s=receiver.pause_s[-1],
            held_gb=held / 1e9,
            tensors=sum(len(s.chain.state) for s in receiver.subscribers),
            peak_rss_gb=_rss_gb(),
            cpu_s=cpu,  # fetch, decode, verify, apply: every thread
            at=done_at,  # CLOCK_MONOTONIC, shared with the parent
        )
    expected = dict(_model(torch.load(traj / f"v{versions}.pt"), tiles))
    exact = True
    for sub in receiver.subscribers:
        for key, piece in sub.chain.state.items():
            p = parse_piece(key)
            source = expected[p.name].reshape(-1)[p.start : p.start + piece.numel()]
            exact &= torch.equal(source.view(torch.uint8), piece.reshape(-1).view(torch.uint8))
    _say(event="checked", bit_exact=bool(exact), tiles=tiles)
    if addrs.startswith("gloo:"):  # a group member stays until its publishers close (collective)
        for source in sources:
            source.closed.wait(600)
    receiver.close()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "engine-map":
        from benchmarks._scale_engine_map import main

        main(Path(sys.argv[2]))
    elif role == "rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:7])
    else:
        receive_main(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
