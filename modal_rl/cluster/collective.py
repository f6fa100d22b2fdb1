"""``python -m modal_rl.cluster.collective --nodes N``: one all-reduce across every node.

A Ray job (the smoke test's and the optional pre-job health check's) that places one actor
on each rank's node (through the per-rank resource ``modal_rl_rank_<i>``), forms a
torch.distributed group over them (Gloo on CPU nodes, NCCL when the node has CUDA), sums
``rank + 1`` and checks the result is ``N (N + 1) / 2``. It prints one JSON line prefixed
``MODAL_RL_COLLECTIVE`` and exits 0 only if every node answered and every sum was right,
all within ``--timeout`` (so a broken fabric fails in seconds, not after NCCL's 30 min).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MARKER = "MODAL_RL_COLLECTIVE"


class _Member:
    """One rank's end of the group. Plain class; wrapped with ray.remote at use."""

    def address(self) -> tuple[str, int]:

        import ray

        ip = ray.util.get_node_ip_address()
        from modal_rl.cluster.ports import reserve

        return ip, reserve(1, ip)[0]

    def all_reduce(self, rank: int, world: int, master: str, port: int, timeout_s: float) -> dict:
        import datetime
        import os

        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        host = f"[{master}]" if ":" in master else master
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            device = "cuda" if backend == "nccl" else "cpu"
            value = torch.tensor([float(rank + 1)], device=device)
            dist.all_reduce(value)
            return {
                "rank": rank,
                "value": float(value.item()),
                "backend": backend,
                "iface": os.environ.get("GLOO_SOCKET_IFNAME"),
            }
        finally:
            dist.destroy_process_group()


def check(nodes: int, timeout_s: float) -> dict:
    import ray

    from modal_rl.cluster.plan import rank_resource

    started = time.monotonic()
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    alive = [n for n in ray.nodes() if n["Alive"]]
    member = ray.remote(num_cpus=0)(_Member)
    actors = [member.options(resources={rank_resource(r): 0.001}).remote() for r in range(nodes)]
    master, port = ray.get(actors[0].address.remote(), timeout=timeout_s)
    refs = [a.all_reduce.remote(r, nodes, master, port, timeout_s) for r, a in enumerate(actors)]
    results = ray.get(refs, timeout=timeout_s)
    expected = nodes * (nodes + 1) / 2
    return {
        "nodes_alive": len(alive),
        "allreduce_ok": all(r["value"] == expected for r in results),
        "allreduce_value": results[0]["value"],
        "expected": expected,
        "backend": results[0]["backend"],
        "iface": results[0]["iface"],
        "node_ips": sorted({n["NodeManagerAddress"] for n in alive}),
        "seconds": round(time.monotonic() - started, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modal_rl.cluster.collective")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        result = check(args.nodes, args.timeout)
    except Exception as exc:  # report any failure as data, then fail the job
        result = {"nodes_alive": None, "allreduce_ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(f"{MARKER} {json.dumps(result)}", flush=True)
    return 0 if result.get("allreduce_ok") and result.get("nodes_alive") == args.nodes else 1


if __name__ == "__main__":
    sys.exit(main())
