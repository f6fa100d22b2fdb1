"""The processes of tests/weightsync/test_weightsync_collective.py: one gloo group on 127.0.0.1.

``python -m tests.collective_procs RANK WORLD PORT KEYS_JSON``: rank 0 publishes a small
trajectory through a ``CollectiveSink`` (with a frame given up part way at version 2 and a
record damaged on the way at version 3); every other rank receives through a
``CollectiveSource`` holding the key ``KEYS_JSON[rank]`` (null: keyless) and prints one JSON
line: the versions it activated, its refusals, the frames it skipped, and whether its weights
equal the last version it activated, bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.subscriber import Subscriber, copy_into
from modal_rl.weightsync.transport.collective import CollectiveSink, CollectiveSource
from tests.weightsync_helpers import model_state, perturb, same_state

VERSIONS = 7
CONFIG = CodecConfig(threads=1, chunk_elems=1 << 12)
EPOCH = 0xC011


def trajectory() -> list[dict[str, torch.Tensor]]:
    out = [model_state(0)]
    for v in range(1, VERSIONS):
        out.append(perturb(out[-1], 0.02, seed=v))
    return out


class DamagingSink(CollectiveSink):
    """Flips one byte of the first chunk record sent while ``damage`` is set (after signing:
    what a bad link or a bad member could do to the bytes)."""

    damage = False

    def _signed(self, records):
        for rec in super()._signed(records):
            if self.damage and rec[:1].upper() == b"C":
                rec = rec[:40] + bytes([rec[40] ^ 1]) + rec[41:]
                self.damage = False
            yield rec


def cut_short(state: dict[str, torch.Tensor]):
    """A trainer whose tensors stop coming part way (the frame is given up)."""
    for i, item in enumerate(state.items()):
        if i == 3:
            raise RuntimeError("trainer stopped mid-version")
        yield item


def publish(group, key: str) -> None:
    states = trajectory()
    sink = DamagingSink(group, 0, key=key)
    publisher = Publisher(sink, anchor_every=3, config=CONFIG, epoch=EPOCH, audit_every_s=None)
    kinds = []
    for v, state in enumerate(states):
        if v == 2:
            try:
                publisher.publish(cut_short(state), version=v)
            except RuntimeError:
                kinds.append("given up")
        sink.damage = v == 3
        kinds.append(publisher.publish(state, version=v).kind)
    sink.close()
    print(json.dumps({"rank": 0, "kinds": kinds}), flush=True)


def receive(group, rank: int, key: str | None) -> None:
    states = trajectory()
    live: dict = {}
    source = CollectiveSource(group, 0, key=key)
    subscriber = Subscriber(source, copy_into(live), CONFIG, audit_every_s=None)
    activated = []
    while not (source.closed.is_set() and source._frames.empty()):
        timing = subscriber.poll(timeout=1.0)
        if timing is not None:
            activated.append(timing.version)
    exact = bool(activated) and same_state(live, states[activated[-1]])
    print(
        json.dumps(
            {
                "rank": rank,
                "activated": activated,
                "refused": subscriber.refused,
                "skipped": source.skipped,
                "exact": exact,
            }
        ),
        flush=True,
    )


def main(rank: int, world: int, port: int, keys: list[str | None]) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    group = dist.new_group(list(range(world)))  # the weight sync's own group
    try:
        if rank == 0:
            publish(group, keys[0])
        else:
            receive(group, rank, keys[rank])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
