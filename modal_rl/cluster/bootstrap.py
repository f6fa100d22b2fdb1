"""The bootstrap: the one function every node of a cluster runs, on Modal and locally.

``bootstrap(rank, addresses, plan)`` pins the collective interfaces, then plays rank 0
(Ray head, join wait, job, follower watch; see ``head.py``) or a follower (join, serve,
exit when rank 0 is done; see ``follower.py``). It returns the process exit code: on rank 0
the job's own exit code, or one of ``plan.EXIT_*`` when the cluster failed around it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import TextIO

from modal_rl.cluster.netif import interface_for
from modal_rl.cluster.plan import BootstrapPlan, address_env_values
from modal_rl.cluster.raynode import node_environment
from modal_rl.run_key import RAY_TOKEN_ENV, MissingRunKeyError, ray_token, run_key


def bootstrap(rank: int, addresses: list[str], plan: BootstrapPlan, out: TextIO | None = None) -> int:
    """Run node ``rank`` of the cluster at ``addresses`` (index = rank) to the end of the job."""
    if len(addresses) != plan.nodes:
        raise ValueError(
            f"plan is for {plan.nodes} nodes but {len(addresses)} addresses were given: {addresses}"
        )
    if not 0 <= rank < plan.nodes:
        raise ValueError(f"rank {rank} is outside 0..{plan.nodes - 1}")
    plan.addresses = list(addresses)
    # NCCL and Gloo must use the interface that carries the cluster address: Gloo otherwise
    # binds to whatever the hostname resolves to, NCCL to the first non-loopback interface.
    iface = interface_for(addresses[rank])
    env = node_environment(plan, iface)
    per_node, shared = address_env_values(plan, rank)
    env.update(shared)  # rank 0 also hands ``env`` to the job's runtime env: shared values only
    if plan.ray_auth == "token":
        # Ray's token is derived from the run key (``ray_token``: an engine's bearer is another
        # derivation, so it submits no job), from this node's environment (the run's Modal Secret,
        # or the local node process's env): `ray start`, the GCS, raylets, workers and our
        # own Job API / state API clients all read it there.
        try:
            os.environ[RAY_TOKEN_ENV] = ray_token(run_key())
        except MissingRunKeyError as exc:
            print(f"[modal_rl.cluster rank {rank}] {exc}", file=sys.stderr, flush=True)
            return 1
    os.environ.update(env)  # inherited by `ray start` and hence by every Ray worker here
    os.environ.update(per_node)
    refresh_ray_auth_cache()
    if rank == 0:
        from modal_rl.cluster.head import Head

        return asyncio.run(Head(plan, env, out or sys.stdout).run())
    from modal_rl.cluster.follower import run_follower

    return run_follower(plan, rank)


def refresh_ray_auth_cache() -> None:
    """Ray caches the auth mode and token per process; a process that already talked to an
    earlier cluster (a notebook, a test session) would present that cluster's token to ours."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is None:
        return
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()
