"""``ClusterSpec``: what a multi-node Ray cluster looks like, validated on construction.

Invariants (checked in ``__post_init__``, so a bad spec never reaches a backend):

- ``nodes`` is an int in ``1..MAX_NODES`` (Modal clusters hold at most 32 containers);
- ``gpu`` parses as ``"TYPE:COUNT"`` with a known type; on Modal a clustered container must
  own every GPU of its host, so multi-node GPU specs need ``COUNT == GPUS_PER_HOST[TYPE]``;
- RDMA needs GPUs (Modal's RDMA fabric is only placed with full GPU hosts);
- volume names are Modal-valid and mount paths absolute and distinct;
- env keys are shell identifiers; secrets are non-empty names;
- timeouts are positive; retries non-negative.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

MAX_NODES = 32
# Modal 1.6's GPU names (its GPU guide), upper-cased as Modal compares them. ``H100!`` pins an
# H100 (no automatic upgrade to an H200); ``B200+`` accepts a B200 or anything newer.
MODAL_GPU_TYPES = (
    "T4",
    "L4",
    "A10",
    "A10G",
    "L40S",
    "A100",
    "A100-40GB",
    "A100-80GB",
    "RTX-PRO-6000",
    "H100",
    "H100!",
    "H200",
    "B200",
    "B200+",
)
# GPUs one container may hold, per type (Modal: 8, A10 4); a larger count never schedules.
MAX_GPUS_PER_CONTAINER = {"A10": 4, "A10G": 4}
DEFAULT_MAX_GPUS_PER_CONTAINER = 8
# GPUs in one host for each type Modal offers in clusters; "all GPUs of a host" is this count.
GPUS_PER_HOST = {
    "H100": 8,
    "H100!": 8,
    "H200": 8,
    "B200": 8,
    "B200+": 8,
    "A100": 8,
    "A100-80GB": 8,
    "A100-40GB": 8,
    "L40S": 4,
}
# Types whose clustered hosts sit on Modal's RDMA fabric (InfiniBand between full hosts):
# multi-node runs on them get RDMA unless --no-rdma says otherwise.
RDMA_GPU_TYPES = ("H100", "H100!", "H200", "B200", "B200+")
KNOWN_GPU_TYPES = set(MODAL_GPU_TYPES)
# Mount points Modal refuses for a Volume (its mount_utils.validate_mount_points).
MODAL_RESERVED_MOUNTS = ("/root", "/tmp")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Set by the run itself: the key travels in a Modal Secret / the process env, never in a spec
# (specs are printed), and Ray's auth mode follows the backend.
RESERVED_ENV = ("MODAL_RL_RUN_KEY", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")


class ClusterSpecError(ValueError):
    """A ClusterSpec (or a flag that builds one) is invalid; the message says which field and why."""


def rdma_default(nodes: int, gpu: str | None) -> bool:
    """RDMA when nothing was asked: on for a multi-node cluster of a type on Modal's RDMA fabric
    (NCCL over TCP between hosts is several times slower for the trainer's all-reduces)."""
    try:
        kind = GpuSpec.parse(gpu).type
    except ClusterSpecError:
        return False  # the spec's own validation names the GPU problem
    return isinstance(nodes, int) and nodes > 1 and kind in RDMA_GPU_TYPES


def rdma_note(spec: ClusterSpec) -> str | None:
    """One line when a multi-node cluster runs without RDMA, else None."""
    kind = spec.gpu_spec.type
    if spec.nodes < 2 or spec.rdma or not kind:
        return None
    if kind in RDMA_GPU_TYPES:
        return (
            f"RDMA is off for this {spec.nodes}-node {kind} cluster (--no-rdma): NCCL goes over TCP "
            "between hosts; drop --no-rdma to turn it on"
        )
    return (
        f"RDMA is off: {kind} hosts are not on Modal's RDMA fabric, so NCCL goes over TCP between "
        f"hosts; use one of {', '.join(RDMA_GPU_TYPES)} for RDMA"
    )


@dataclass(frozen=True)
class GpuSpec:
    """``TYPE:COUNT`` per node; ``count == 0`` means no GPU (local backend only)."""

    type: str | None
    count: int

    @classmethod
    def parse(cls, text: str | None) -> GpuSpec:
        if text is None or text == "" or text.lower() == "none":
            return cls(None, 0)
        kind, _, count_text = text.partition(":")
        kind = kind.strip().upper()
        if kind not in {k.upper() for k in KNOWN_GPU_TYPES}:
            raise ClusterSpecError(
                f"gpu={text!r}: unknown GPU type {kind!r}; known: {', '.join(sorted(KNOWN_GPU_TYPES))}"
            )
        kind = next(k for k in KNOWN_GPU_TYPES if k.upper() == kind)
        try:
            count = int(count_text) if count_text else 1
        except ValueError:
            raise ClusterSpecError(f"gpu={text!r}: count {count_text!r} is not an integer") from None
        if count < 1:
            raise ClusterSpecError(f"gpu={text!r}: count must be at least 1")
        most = MAX_GPUS_PER_CONTAINER.get(kind, DEFAULT_MAX_GPUS_PER_CONTAINER)
        if count > most:
            raise ClusterSpecError(
                f"gpu={text!r}: Modal gives one container at most {most} {kind} GPUs; "
                f"use --gpu {kind}:{most} with more --nodes"
            )
        return cls(kind, count)

    def __str__(self) -> str:
        return f"{self.type}:{self.count}" if self.type else "none"


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster of ``nodes`` identical nodes with ``gpu`` per node.

    ``volumes`` maps a Modal Volume name to its mount path in every container; ``secrets``
    are Modal Secret names; ``env`` is set on every node before Ray starts and in the job's
    runtime env. ``join_timeout_s`` bounds the wait for all nodes to register with Ray;
    ``job_timeout_s`` bounds the job (and, on Modal, the function's ``timeout=``).
    ``dashboard`` forwards Ray's dashboard out of the cluster (Modal: a TLS tunnel that
    still demands the run's token). ``local_gpus_per_node`` is the count of *logical* GPUs the local backend declares to Ray
    when ``gpu`` is ``None`` (so GPU-scheduled frameworks run on a CPU machine).
    """

    nodes: int = 2
    gpu: str | None = None
    # None: decided by the cluster (``rdma_default``): on for multi-node on RDMA GPU types.
    rdma: bool | None = False
    image: str | None = None
    volumes: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    join_timeout_s: float = 300.0
    job_timeout_s: float = 24 * 3600.0
    retries: int = 0
    region: str | None = None
    cloud: str | None = None
    cpu: float | None = None
    local_gpus_per_node: int = 1
    dashboard: bool = False

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise through object.__setattr__ so a spec built from lists
        # or a JSON dict compares and hashes like one built from tuples.
        if self.rdma is None:
            object.__setattr__(self, "rdma", rdma_default(self.nodes, self.gpu))
        object.__setattr__(self, "secrets", tuple(self.secrets))
        object.__setattr__(self, "volumes", dict(self.volumes))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})
        self._validate()

    @property
    def gpu_spec(self) -> GpuSpec:
        return GpuSpec.parse(self.gpu)

    @property
    def gpus_per_node(self) -> int:
        """GPUs Ray sees per node: the real count, or the local backend's logical count."""
        spec = self.gpu_spec
        return spec.count if spec.type else self.local_gpus_per_node

    def _validate(self) -> None:
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool):
            raise ClusterSpecError(f"nodes={self.nodes!r}: must be an integer")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ClusterSpecError(
                f"nodes={self.nodes}: must be between 1 and {MAX_NODES} (Modal's cluster limit)"
            )
        gpu = GpuSpec.parse(self.gpu)
        if gpu.type and self.nodes > 1 and gpu.type in GPUS_PER_HOST and gpu.count != GPUS_PER_HOST[gpu.type]:
            raise ClusterSpecError(
                f"gpu={self.gpu!r} with nodes={self.nodes}: Modal clusters need all GPUs of a host per "
                f"container; use gpu='{gpu.type}:{GPUS_PER_HOST[gpu.type]}'"
            )
        if gpu.type and self.nodes > 1 and gpu.type not in GPUS_PER_HOST:
            raise ClusterSpecError(
                f"gpu={self.gpu!r}: {gpu.type} is not offered for multi-node clusters; "
                f"use one of {', '.join(sorted(GPUS_PER_HOST))}"
            )
        if self.rdma and not gpu.type:
            raise ClusterSpecError(
                "rdma=True needs GPUs: Modal places its RDMA fabric only with full GPU hosts"
            )
        if not isinstance(self.local_gpus_per_node, int) or self.local_gpus_per_node < 0:
            raise ClusterSpecError(
                f"local_gpus_per_node={self.local_gpus_per_node!r}: must be an integer >= 0"
            )
        paths: dict[str, str] = {}
        for name, path in self.volumes.items():
            if not _NAME_RE.match(str(name)):
                raise ClusterSpecError(
                    f"volume name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting alphanumeric"
                )
            if not str(path).startswith("/") or str(path).rstrip("/") in ("", "/"):
                raise ClusterSpecError(f"volume {name!r}: mount path {path!r} must be absolute and not '/'")
            if posixpath.normpath(str(path)) != str(path):
                raise ClusterSpecError(
                    f"--volume {name}:{path}: Modal wants a canonical mount path; "
                    f"use --volume {name}:{posixpath.normpath(str(path))}"
                )
            if str(path) in MODAL_RESERVED_MOUNTS:
                raise ClusterSpecError(
                    f"--volume {name}:{path}: Modal cannot mount a Volume at {path} (the container's "
                    f"own directory); mount it below, e.g. --volume {name}:{path}/{name}"
                )
            if path in paths:
                raise ClusterSpecError(f"volumes {paths[path]!r} and {name!r} both mount at {path!r}")
            paths[path] = name
        for secret in self.secrets:
            if not isinstance(secret, str) or not _NAME_RE.match(secret):
                raise ClusterSpecError(f"secret name {secret!r}: use 1-64 letters, digits, '.', '_' or '-'")
        for key in self.env:
            if not _ENV_RE.match(key):
                raise ClusterSpecError(
                    f"env key {key!r}: must be a shell identifier ([A-Za-z_][A-Za-z0-9_]*)"
                )
            if key in RESERVED_ENV:
                raise ClusterSpecError(
                    f"env key {key}: set by the run itself (the run key travels in a Modal Secret or "
                    "the process env, never in --env); export MODAL_RL_RUN_KEY to choose the key, "
                    "MODAL_RL_RAY_AUTH=token for Ray auth on a local cluster"
                )
        for name in ("join_timeout_s", "job_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ClusterSpecError(f"{name}={value!r}: must be a positive number of seconds")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ClusterSpecError(f"retries={self.retries!r}: must be an integer >= 0")
        if self.cpu is not None and (not isinstance(self.cpu, int | float) or self.cpu <= 0):
            raise ClusterSpecError(f"cpu={self.cpu!r}: must be a positive number of cores")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["secrets"] = list(self.secrets)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterSpec:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ClusterSpecError(f"unknown ClusterSpec fields: {', '.join(sorted(unknown))}")
        return cls(**data)

    def replace(self, **changes: Any) -> ClusterSpec:
        return dataclasses.replace(self, **changes)
