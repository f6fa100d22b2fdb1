"""Clusters: ClusterSpec, the Ray bootstrap, and the modal / local backends.

- ``ClusterSpec`` (``spec.py``): nodes, GPUs, RDMA, image, volumes, secrets, env, timeouts;
  validated on construction.
- ``bootstrap`` (``bootstrap.py``): the one function every node runs (rank 0: head, join
  wait, Ray job, follower watch; others: join and serve).
- Backends (``backend.py`` port, chosen by name in ``backends.py``): ``LocalBackend`` (N Ray
  nodes as local processes, the default) and ``ModalBackend`` (one ``modal.clustered`` function).
- ``run_job`` / ``add_cluster_args`` (``cli.py``): what ``verl_modal`` and ``slime_modal`` call.

Heavy imports (ray, modal, torch) happen inside functions, so importing this is cheap.
"""

from modal_rl.cluster.backend import ClusterBackend, JobRequest
from modal_rl.cluster.backends import get_backend
from modal_rl.cluster.cli import add_cluster_args, run_job, spec_from_args, split_passthrough
from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.preflight import PreflightError, run_preflight
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError, GpuSpec

__all__ = [
    "BootstrapPlan",
    "ClusterBackend",
    "ClusterSpec",
    "ClusterSpecError",
    "GpuSpec",
    "JobRequest",
    "PreflightError",
    "add_cluster_args",
    "get_backend",
    "run_job",
    "run_preflight",
    "spec_from_args",
    "split_passthrough",
]
