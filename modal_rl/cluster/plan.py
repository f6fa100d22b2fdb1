"""``BootstrapPlan``: everything every rank needs to play its part, identical on all ranks.

A backend turns (ClusterSpec, entrypoint, runtime env) into one plan, serialises it to JSON
and hands it to each node together with that node's rank; only ``addresses`` may be filled
in late (on Modal the cluster's IPs are known only inside the containers). Nothing in here
depends on the backend, which is what makes the local cluster test the Modal code path.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

# Default ports for nodes that each own a network namespace (Modal containers).
GCS_PORT = 6379
DASHBOARD_PORT = 8265
CONTROL_PORT = 6390

# Exit codes of rank 0 that are not the job's own.
EXIT_FOLLOWER_LOST = 70
EXIT_JOIN_TIMEOUT = 71
EXIT_COLLECTIVE_FAILED = 72
EXIT_HEAD_FAILED = 73
EXIT_JOB_TIMEOUT = 124

# Ray's authentication mode (``RAY_AUTH_MODE``) per plan: "token" on every Modal cluster (the
# token is the run key, from the run's Modal Secret), "disabled" by default on a local
# loopback cluster; ``MODAL_RL_RAY_AUTH=token`` (or ``LocalBackend(ray_auth="token")``) turns
# it on there too, so the same bring-up is tested with auth on.
RAY_AUTH_MODES = ("token", "disabled")
RAY_AUTH_SWITCH_ENV = "MODAL_RL_RAY_AUTH"

# Set on every node before Ray starts, and why (docs/clusters.md repeats this table);
# ``RAY_AUTH_MODE`` is added from the plan (``node_environment``), after the user's env.
BASE_ENV = {
    # No usage reports leave the cluster.
    "RAY_USAGE_STATS_ENABLED": "0",
    # On SIGTERM, stop at once instead of draining for 30 s: teardown is ours to time.
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    # Unbuffered Python output, so log lines reach rank 0 as they are printed.
    "PYTHONUNBUFFERED": "1",
}


ADDRESS_KINDS = ("node", "head", "no_proxy")


def address_env_values(plan: BootstrapPlan, rank: int) -> tuple[dict[str, str], dict[str, str]]:
    """``(per_node, shared)`` values of ``plan.address_env`` on ``rank``.

    ``node``: this node's cluster address (differs per node, so it is kept out of the job's
    runtime env, which every worker of the job shares; Ray workers inherit it from their
    node instead). ``head``: rank 0's address. ``no_proxy``: loopback plus every node's
    address, so HTTP clients inside the cluster never go through a proxy.
    """
    assert plan.addresses, "addresses are filled in before bootstrap"
    per_node: dict[str, str] = {}
    shared: dict[str, str] = {}
    bypass = ",".join(dict.fromkeys(["127.0.0.1", "localhost", *plan.addresses]))
    for name, kind in plan.address_env.items():
        if kind == "node":
            per_node[name] = plan.addresses[rank]
        elif kind == "head":
            shared[name] = plan.addresses[0]
        elif kind == "no_proxy":
            shared[name] = bypass
        else:
            raise ValueError(f"address_env {name}: unknown kind {kind!r}; one of {ADDRESS_KINDS}")
    return per_node, shared


def hostport(host: str, port: int) -> str:
    """``host:port`` with IPv6 hosts bracketed, as Ray and URLs expect."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rank_resource(rank: int) -> str:
    """Custom Ray resource that tags rank ``rank``'s node (and only it): a missing node has a
    name, and work can be placed on a chosen rank."""
    return f"modal_rl_rank_{rank}"


@dataclass
class BootstrapPlan:
    """The per-run bring-up plan. Invariant: ``len(addresses) == nodes`` once set."""

    nodes: int
    gpus_per_node: int
    entrypoint: list[str]
    runtime_env: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    addresses: list[str] | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    gcs_port: int = GCS_PORT
    dashboard_port: int = DASHBOARD_PORT
    control_port: int = CONTROL_PORT
    dashboard_host: str | None = None  # None: the head's cluster address
    # Extra ``ray start`` flags per rank (distinct ports when nodes share a host); may be empty.
    node_flags: list[list[str]] = field(default_factory=list)
    cpus_per_node: float | None = None
    object_store_bytes: int | None = None
    temp_root: str | None = None  # per-rank Ray temp dir is temp_root/r<rank> (nodes sharing a host)
    join_timeout_s: float = 300.0
    head_timeout_s: float = 180.0  # the head's own start-up; the join clock starts after it
    job_timeout_s: float = 24 * 3600.0
    collective_check: bool = False
    collective_timeout_s: float = 60.0
    heartbeat_s: float = 1.0
    lost_after_s: float = 5.0
    address_env: dict[str, str] = field(default_factory=dict)  # name -> kind, see address_env_values
    # "token": every Ray endpoint (GCS, dashboard, Job API) demands the run key, which each
    # node reads from its environment (never from this plan: plans are printed and shipped).
    ray_auth: str = "token"
    dashboard: bool = False  # forward the dashboard out of the cluster (Modal: a TLS tunnel)
    # Platform retries of the whole cluster (Modal's function retries): rank 0 turns a lost node
    # into an exception only when there are retries to use (see modal_rl.cluster.retries).
    retries: int = 0

    def __post_init__(self) -> None:
        if self.ray_auth not in RAY_AUTH_MODES:
            from modal_rl.cluster.spec import ClusterSpecError

            raise ClusterSpecError(
                f"Ray auth mode {self.ray_auth!r} (from {RAY_AUTH_SWITCH_ENV}?): use one of {RAY_AUTH_MODES}"
            )

    def head_address(self) -> str:
        assert self.addresses, "addresses are filled in before bootstrap"
        return self.addresses[0]

    def dashboard_url(self) -> str:
        return f"http://{hostport(self.head_address(), self.dashboard_port)}"

    def rank_resource(self, rank: int) -> str:
        return rank_resource(rank)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> BootstrapPlan:
        return cls(**json.loads(text))
