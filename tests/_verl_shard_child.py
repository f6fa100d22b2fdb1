"""Child of ``test_verl_sharded_sync``: two real FSDP2 ranks (``fully_shard``, gloo, CPU) each run
a ``ModalDeltaCheckpointEngine(sharded=True)`` fed by verl's own FSDP shard export
(``FSDPEngine.get_per_tensor_param_shard``, run on the ranks' sharded module), and this
process plays verl's ``CheckpointEngineManager``: ``prepare`` on every worker, ``build_topology``,
``init_process_group``, then the ranks' ``send_weights`` while a rollout engine here
``receive_weights``. Adam steps between versions.

Written to OUT_DIR: ``recv{v}.pt`` (what the rollout engine yielded), ``full{v}.pt`` (rank 0's
gathered reference: verification only, the publish path never gathers), ``held{r}.txt``
(``VERSION HELD FULL`` element counts of rank r's publisher snapshot), ``bad{r}.txt`` (the
error a Shard(1) parameter gives).

Usage: python -m tests._verl_shard_child OUT_DIR VERSIONS"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import torch

WORLD = 2


class Exporter:
    """The part of verl's ``FSDPEngine`` its shard export reads: the FSDP2 module."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        self.get_per_tensor_param_shard = FSDPEngine.get_per_tensor_param_shard.__get__(self)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(33, 70), torch.nn.Tanh(), torch.nn.Linear(70, 5), torch.nn.Linear(5, 1)
    )
    net.register_buffer("scale", torch.linspace(0.5, 1.5, 7))  # a plain tensor: rank 0 publishes it
    return net


def rank_main(rank: int, out: Path, versions: int, inbox, outbox) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # nothing listens off loopback
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import verl_modal.cpu.platform  # noqa: F401  (VERL_PLATFORM=cpu: verl's device is the CPU)
    from verl_modal.checkpoint_engine import ModalDeltaCheckpointEngine

    net = model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    engine = ModalDeltaCheckpointEngine(1 << 20, is_master=rank == 0, sharded=True, anchor_every=None)
    exporter = Exporter(net)
    for version in range(versions):
        if version:
            net(torch.randn(16, 33)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        outbox.put((rank, engine.prepare()))
        engine.init_process_group(**inbox.get())
        metrics = asyncio.run(engine.send_weights(exporter, global_steps=version))
        full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in net.state_dict().items()}
        full = {n: t.detach().to(torch.bfloat16) for n, t in full.items()}  # the reference only
        if rank == 0:
            torch.save(full, out / f"full{version}.pt")
        held = sum(t.numel() for t in engine._publisher.snapshot.values())
        with open(out / f"held{rank}.txt", "a") as f:
            f.write(
                f"{version} {held} {sum(t.numel() for t in full.values())} {metrics['checkpoint_engine/version']}\n"
            )
        engine.finalize()
        outbox.put((rank, "sent"))
    # a column-sharded parameter (Shard(1), e.g. tensor parallel) is not a flat range: refused
    bad = torch.nn.Module()
    bad.w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    sharded_bad = ModalDeltaCheckpointEngine(1 << 20, is_master=rank == 0, sharded=True)
    try:
        asyncio.run(sharded_bad.send_weights(Exporter(bad), global_steps=0))
        message = "no error"
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc} | sent={sharded_bad._publisher.version}"
    (out / f"bad{rank}.txt").write_text(message)
    sharded_bad.close()
    engine.close()
    dist.destroy_process_group()


def main(out: Path, versions: int) -> None:
    import multiprocessing as mp

    from verl_modal.checkpoint_engine import ModalDeltaCheckpointEngine

    ctx = mp.get_context("spawn")
    inboxes, outbox = [ctx.Queue() for _ in range(WORLD)], ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, out, versions, inboxes[r], outbox)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rollout = ModalDeltaCheckpointEngine(1 << 20, receive_timeout_s=120)  # no is_master: a rollout worker

    def collect() -> dict:
        got = {}
        while len(got) < WORLD:
            rank, item = outbox.get(timeout=300)
            got[rank] = item
        return got

    async def receive(step: int) -> dict:
        return {n: t.clone() async for n, t in rollout.receive_weights(global_steps=step)}

    try:
        for version in range(versions):
            announced = collect()
            metadata = [announced[r] for r in range(WORLD)] + [rollout.prepare()]
            actor_kw, rollout_kw = ModalDeltaCheckpointEngine.build_topology(WORLD, 1, metadata)
            for r in range(WORLD):
                inboxes[r].put({k: v[r] for k, v in actor_kw.items()})
            rollout.init_process_group(**{k: v[0] for k, v in rollout_kw.items()})
            torch.save(asyncio.run(receive(version)), out / f"recv{version}.pt")
            (out / f"rollout{version}.txt").write_text(repr(rollout.metrics))
            rollout.finalize()
            collect()  # both ranks sent and wrote their reference
        for p in procs:
            p.join(timeout=300)
    finally:
        rollout.close()
        for p in procs:
            if p.is_alive():
                p.kill()
    sys.exit(max(p.exitcode or 0 for p in procs))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
