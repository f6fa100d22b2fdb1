"""``python -m modal_rl.weightsync receive``: a stand-alone subscriber process.

It follows a publisher over TCP (``--tcp HOST:PORT``) or a store (``--store DIR``) until
``--until`` is live, optionally re-serving what it receives to others (``--relay-port``),
prints one JSON line per activated version (timings), and writes the final live weights to
``--out`` (safetensors). Frames are verified with the run's key from ``MODAL_RL_RUN_KEY``
(``--keyless``: unsigned frames, no handshake); a relay admits its receivers with the same
key and forwards records unchanged. Used by the fault tests and the end-to-end benchmark as a real
receiver process, and usable by maintainers to watch a run's weight stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from modal_rl.weightsync.codec import CodecConfig
from modal_rl.weightsync.subscriber import Subscriber, copy_into


def add_parser(sub) -> None:
    rec = sub.add_parser("receive", help="follow a publisher until a version is live")
    where = rec.add_mutually_exclusive_group(required=True)
    where.add_argument("--tcp", help="HOST:PORT of a publisher's frame server")
    where.add_argument("--store", type=Path, help="directory of a store transport")
    rec.add_argument("--until", type=int, required=True, help="stop once this version is live")
    rec.add_argument("--timeout", type=float, default=300.0)
    rec.add_argument("--out", type=Path, help="write the live weights here (safetensors)")
    rec.add_argument("--relay-port", type=int, help="re-serve received records on this port")
    rec.add_argument("--relay-gbps", type=float, help="rate limit of the relay's link")
    rec.add_argument("--threads", type=int, default=2)
    from modal_rl.weightsync.cli import add_key_flag

    add_key_flag(rec)
    rec.set_defaults(fn=cmd_receive)


def cmd_receive(args: argparse.Namespace) -> int:
    import torch

    from modal_rl.weightsync.cli import keys_of
    from modal_rl.weightsync.transport import gbps

    keys = keys_of(args)
    # One receiver is one engine's sync agent: keep torch's intra-op pool from spinning
    # on cores the engine (and, in tests, the other receivers) need.
    torch.set_num_threads(args.threads)

    relay = None
    if args.store is not None:
        from modal_rl.weightsync.transport_store import DirectoryStore

        source = DirectoryStore(args.store, key=keys)
    else:
        from modal_rl.weightsync.transport_tcp import FrameServer, TcpSource

        host, _, port = args.tcp.rpartition(":")
        if args.relay_port is not None:
            relay = FrameServer(
                "127.0.0.1", args.relay_port, key=keys, rate_bytes_per_s=gbps(args.relay_gbps)
            )
        source = TcpSource(host, int(port), key=keys, on_record=relay.forward if relay else None)
    live: dict = {}
    subscriber = Subscriber(source, copy_into(live), CodecConfig(threads=args.threads))
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    deadline = time.monotonic() + args.timeout
    try:
        while subscriber.live_version is None or subscriber.live_version < args.until:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                print(f"error: version {args.until} not live after {args.timeout}s", file=sys.stderr)
                return 1
            timing = subscriber.poll(remaining)
            if timing is not None:
                print(json.dumps({"event": "activated", **asdict(timing)}), flush=True)
            elif subscriber.refused:
                print(json.dumps({"event": "refused", "error": subscriber.refused[-1]}), flush=True)
                subscriber.refused.clear()
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
