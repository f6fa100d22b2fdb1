"""The cluster port: a backend realises a ClusterSpec and runs one job on it.

Both implementations hand the same ``BootstrapPlan`` to the same ``bootstrap`` function on
every node; they differ only in where nodes come from (processes here, Modal containers
there) and how rank/addresses reach each node.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from modal_rl.cluster.plan import ADDRESS_KINDS, BootstrapPlan
from modal_rl.cluster.spec import ClusterSpec


@dataclass
class JobRequest:
    """What to run on the cluster: argv for the Ray job's driver and its runtime env."""

    entrypoint: list[str]
    runtime_env: dict[str, Any] = field(default_factory=dict)
    collective_check: bool = False
    collective_timeout_s: float = 60.0
    # Env var name -> which cluster address it gets at bring-up ("node", "head" or "no_proxy";
    # see ``plan.address_env_values``): addresses exist only once the nodes do.
    address_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.address_env.items() if v not in ADDRESS_KINDS}
        if bad:
            raise ValueError(f"address_env kinds must be one of {ADDRESS_KINDS}, got {bad}")
        if not self.entrypoint or not all(isinstance(a, str) for a in self.entrypoint):
            raise ValueError(f"entrypoint must be a non-empty list of strings, got {self.entrypoint!r}")


class ClusterBackend(ABC):
    """Port: ``describe`` (for --dry-run, touches nothing) and ``run`` (blocks until the job ends)."""

    name: str
    can_detach: bool = False
    detach_note: str = ""

    @abstractmethod
    def make_plan(self, spec: ClusterSpec, job: JobRequest) -> BootstrapPlan:
        """The plan every node gets; no process, container or network is touched."""

    @abstractmethod
    def describe(self, spec: ClusterSpec, job: JobRequest) -> dict[str, Any]:
        """A JSON-able plan: spec, image, per-rank commands, env; what --dry-run prints."""

    @abstractmethod
    def run(self, spec: ClusterSpec, job: JobRequest) -> int:
        """Bring the cluster up, run the job, tear down; returns rank 0's exit code."""

    def spawn(self, spec: ClusterSpec, job: JobRequest) -> str:
        """Start the run and return an id without waiting (only where ``can_detach``)."""
        raise NotImplementedError(f"backend {self.name!r} cannot detach: {self.detach_note}")


def plan_from(spec: ClusterSpec, job: JobRequest, **overrides: Any) -> BootstrapPlan:
    """The backend-neutral part of a plan."""
    fields: dict[str, Any] = dict(
        nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node,
        entrypoint=list(job.entrypoint),
        runtime_env=dict(job.runtime_env),
        env=dict(spec.env),
        join_timeout_s=float(spec.join_timeout_s),
        job_timeout_s=float(spec.job_timeout_s),
        collective_check=job.collective_check,
        collective_timeout_s=job.collective_timeout_s,
        cpus_per_node=spec.cpu,
        address_env=dict(job.address_env),
        dashboard=spec.dashboard,
        retries=spec.retries,
    )
    fields.update(overrides)
    return BootstrapPlan(**fields)
