"""``python -m modal_rl.weightsync receive``: a stand-alone subscriber process.

It follows a publisher over TCP (``--tcp HOST:PORT``) or a store (``--store DIR``) until
``--until`` is live (without ``--until``: until ``--timeout``, then exits 0), optionally
re-serving what it receives to others (``--relay-port``), prints one JSON line per event
(``ready``; ``activated`` with the version, its epoch and run, and timings; ``refused``;
``done``), and writes the final live weights to ``--out`` (safetensors).

``--status-file PATH`` keeps a JSON file with what the receiver serves, rewritten atomically
(temporary name, rename) at start and after every activation or refusal:
``Subscriber.status()`` (``run``, ``epoch``, ``version``, ``kind``, ``activated_at``,
``started_at``, ``activations``, ``refused``) plus ``pid``. A harness that kills and restarts
receivers reads it to learn which version and epoch each one holds and how long it took to
serve again (``activated_at - started_at``; times are ``time.time()``). ``--floor V``
(``--floor-epoch E``) is a version the caller knows was published: nothing below it is
activated and a store whose ``latest`` is below it is refused (a cold receiver has no other
way to tell a rolled-back store). Frames are verified with the run's key from ``MODAL_RL_RUN_KEY``
(``--keyless``: unsigned frames, no handshake); a relay admits its receivers with the same
key and forwards records unchanged. Used by the fault tests and the end-to-end benchmark as a real
receiver process, and usable by maintainers to watch a run's weight stream.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.subscriber import Subscriber, copy_into

WARM_UP_WAIT_S = 60.0  # a host too busy to load the kernels in this long is ready without them


def add_parser(sub) -> None:
    rec = sub.add_parser("receive", help="follow a publisher until a version is live")
    where = rec.add_mutually_exclusive_group(required=True)
    where.add_argument("--tcp", help="HOST:PORT of a publisher's frame server")
    where.add_argument("--store", type=Path, help="directory of a store transport")
    rec.add_argument("--until", type=int, help="stop once this version is live (default: follow)")
    rec.add_argument("--timeout", type=float, default=300.0)
    rec.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        help="give up when no connection to --tcp succeeded for this long (default 30 s)",
    )
    rec.add_argument("--status-file", type=Path, help="keep what this receiver serves in this JSON file")
    rec.add_argument(
        "--floor",
        type=int,
        metavar="VERSION",
        help="never activate a version below this one (one you know was published: a store rolled "
        "back below it is refused)",
    )
    rec.add_argument(
        "--floor-epoch",
        type=_epoch,
        metavar="EPOCH",
        help="the epoch of --floor, as 'activated' lines and --status-file show it (0x... for hex); "
        "without it --floor is a version number of any epoch",
    )
    rec.add_argument("--out", type=Path, help="write the live weights here (safetensors)")
    rec.add_argument("--relay-port", type=int, help="re-serve received records on this port")
    rec.add_argument("--relay-gbps", type=float, help="rate limit of the relay's link")
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument(
        "--no-live-copy",
        action="store_true",
        help="activate without copying the staged weights into a second, live copy (saves one "
        "copy of the model: benchmarks at model scale); incompatible with --out",
    )
    from modal_rl.weightsync.cli.common import add_key_flag

    add_key_flag(rec)
    rec.set_defaults(fn=cmd_receive)


def _epoch(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an epoch (an integer; 0x... for hex)") from None


def _address(text: str) -> tuple[str, int]:
    from modal_rl.weightsync.cli.common import CliError

    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(f"--tcp {text}: expected HOST:PORT (e.g. 127.0.0.1:7000)")
    return host.strip("[]"), int(port)


def _write_status(path: Path | None, subscriber: Subscriber) -> None:
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps({**subscriber.status(), "pid": os.getpid()}))
    os.replace(tmp, path)


def cmd_receive(args: argparse.Namespace) -> int:
    import torch

    from modal_rl.weightsync.cli.common import FAILED, CliError, check_out, keys_of
    from modal_rl.weightsync.transport.base import gbps

    addr = _address(args.tcp) if args.tcp is not None else None
    for out in (args.out, args.status_file):
        if out is not None:
            check_out(out)
    if args.no_live_copy and args.out is not None:
        raise CliError("--no-live-copy keeps no live weights to write: drop --out or --no-live-copy")
    if args.store is not None and not args.store.is_dir():
        raise CliError(f"--store {args.store}: no such directory")
    keys = keys_of(args)
    # One receiver is one engine's sync agent: keep torch's intra-op pool from spinning
    # on cores the engine (and, in tests, the other receivers) need.
    torch.set_num_threads(args.threads)

    relay = None
    if args.store is not None:
        from modal_rl.weightsync.transport.store import DirectoryStore

        source = DirectoryStore(args.store, key=keys)
    else:
        from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource

        host, port = addr
        if args.relay_port is not None:
            relay = FrameServer(
                "127.0.0.1", args.relay_port, key=keys, rate_bytes_per_s=gbps(args.relay_gbps)
            )
        source = TcpSource(host, int(port), key=keys, on_record=relay.forward if relay else None)
    live: dict = {}
    subscriber = Subscriber(
        source,
        (lambda _state, _version: None) if args.no_live_copy else copy_into(live),
        CodecConfig(threads=args.threads),
        floor_version=args.floor,
        floor_epoch=args.floor_epoch,
    )
    _write_status(args.status_file, subscriber)
    # "ready" only once the codec's kernels are loaded (``warmup``): a receiver that takes
    # traffic does not pay their first use on its first delta
    from modal_rl.weightsync.codec.warmup import wait_warm

    wait_warm(WARM_UP_WAIT_S)
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    started = time.monotonic()
    deadline = started + args.timeout
    refused = 0
    try:
        while args.until is None or subscriber.live_version is None or subscriber.live_version < args.until:
            remaining = deadline - time.monotonic()
            unreachable = addr is not None and not source.connected_once and source.last_error
            if unreachable and time.monotonic() - started >= min(args.connect_timeout, args.timeout):
                raise CliError(
                    f"cannot reach the frame server at {host}:{port}: {source.last_error} for "
                    f"{min(args.connect_timeout, args.timeout):g}s; is the publisher running there? "
                    "check --tcp HOST:PORT",
                    FAILED,
                )
            if remaining <= 0:
                if args.until is None:
                    break  # following: the time is up
                raise CliError(f"version {args.until} not live after {args.timeout:g}s", FAILED)
            if addr is not None and not source.connected_once:
                remaining = min(remaining, max(0.05, started + args.connect_timeout - time.monotonic()))
            timing = subscriber.poll(min(remaining, 1.0) if args.status_file else remaining)
            if timing is not None:
                event = {"event": "activated", **asdict(timing), "run": subscriber.chain.run}
                print(json.dumps(event), flush=True)
                _write_status(args.status_file, subscriber)
            elif len(subscriber.refused) > refused:
                refused = len(subscriber.refused)
                print(json.dumps({"event": "refused", "error": subscriber.refused[-1]}), flush=True)
                _write_status(args.status_file, subscriber)
        if args.out is not None:
            from safetensors.torch import save_file

            save_file(live, str(args.out))
        if relay is not None:  # stay up until downstream receivers drain what we forwarded
            time.sleep(0.2)
        print(json.dumps({"event": "done", "version": subscriber.live_version}), flush=True)
        return 0
    finally:
        source.close()
        if relay is not None:
            relay.close()
