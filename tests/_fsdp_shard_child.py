"""Child of ``test_weightsync_shards``: two real FSDP2 ranks (gloo, CPU) train a small model
and each publishes only its ``Shard(0)`` local tensors (``dtensor_pieces``, no gather) to its
own store. Rank 0 also saves the gathered full state of every version as the test's
reference (verification only: the publish path never gathers).

Usage: python -m tests._fsdp_shard_child OUT_DIR VERSIONS"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def rank_main(rank: int, world: int, out: Path, versions: int) -> None:
    # nothing listens off loopback: a file rendezvous (a TCP store binds every interface)
    # and gloo's pair sockets on lo (by default: the host name's interface)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from modal_rl.weightsync import CodecConfig
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.shards import dtensor_pieces
    from modal_rl.weightsync.transport.store import DirectoryStore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.Tanh(), torch.nn.Linear(70, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    publisher = Publisher(
        DirectoryStore(out / f"rank{rank}"), anchor_every=None, config=CodecConfig(chunk_elems=512), epoch=11
    )
    for version in range(versions):
        if version:
            x = torch.randn(16, 33)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        bf16 = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
        publisher.publish(dtensor_pieces(bf16), version)
        full = {n: p.full_tensor() for n, p in bf16}  # the reference only
        held = sum(t.numel() for t in publisher.snapshot.values())
        if rank == 0:
            torch.save(full, out / f"full{version}.pt")
        with open(out / f"held{rank}.txt", "a") as f:  # a file: the ranks' stdout interleaves
            f.write(f"{version} {held} {sum(t.numel() for t in full.values())}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    out_dir, count = Path(sys.argv[1]), int(sys.argv[2])
    mp.spawn(rank_main, args=(2, out_dir, count), nprocs=2)
