"""Modal backend: one clustered Modal Function whose N containers run the bootstrap.

``build_function`` defines a ``modal.App`` with one function, decorated
``@app.function(gpu=..., image=..., volumes=..., secrets=..., timeout=..., retries=...)``
over ``@modal.clustered(size=N, rdma=...)``. Calling it with the plan JSON broadcasts the
input to every container; each reads its rank and the cluster's addresses from
``modal.experimental.get_cluster_info()`` (IPv4 when Modal gives them, since Ray's IPv6
support is the younger path) and runs ``bootstrap``; rank 0 forwards the Ray dashboard with
``modal.forward`` and returns ``{"exit_code", "tail"}``, which Modal hands back (only rank
0's output is returned for clustered functions).

Nothing here contacts Modal until ``run``; ``build_function`` works offline, which is how
the function's settings are tested without a server.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

from modal_rl.cluster.backend import ClusterBackend, JobRequest, plan_from
from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.raynode import node_environment
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError

RAY_VERSION = "2.60.0"
MAX_MODAL_TIMEOUT_S = 24 * 3600
# Time the function needs beyond the job itself: image pull, Ray start, join wait, teardown.
TIMEOUT_MARGIN_S = 600


def function_kwargs(spec: ClusterSpec) -> dict[str, Any]:
    """The plain (non-Modal-object) settings of the function, derived from the spec only."""
    timeout = int(min(MAX_MODAL_TIMEOUT_S, spec.job_timeout_s + spec.join_timeout_s + TIMEOUT_MARGIN_S))
    kwargs: dict[str, Any] = {"gpu": str(spec.gpu_spec), "timeout": timeout, "retries": spec.retries}
    if spec.region:
        kwargs["region"] = spec.region
    if spec.cloud:
        kwargs["cloud"] = spec.cloud
    if spec.cpu is not None:
        kwargs["cpu"] = spec.cpu
    return kwargs


def validate_for_modal(spec: ClusterSpec) -> None:
    if not spec.gpu_spec.type:
        raise ClusterSpecError("--backend modal needs --gpu (Modal clusters are GPU-only), e.g. --gpu H100:8")


# This project's packages, shipped as source into every container: the core and the thin
# adapters (they import their framework lazily, so unused ones cost nothing).
LOCAL_PACKAGES = ("modal_rl", "verl_modal", "slime_modal")


def build_image(spec: ClusterSpec):
    """The user's registry image, or Debian slim with Ray and torch, plus this project's
    packages as source. A registry image keeps its own Python: framework images (verl's,
    slime's) carry the framework, torch and Ray in it, and a second interpreter would not."""
    import modal

    if spec.image:
        image = modal.Image.from_registry(spec.image)
    else:
        image = modal.Image.debian_slim(python_version="3.11").pip_install(
            f"ray[default]=={RAY_VERSION}", "torch"
        )
    return image.add_local_python_source(*LOCAL_PACKAGES)


def container_main(plan_json: str, forward_dashboard: bool = True) -> dict:
    """Body of every container. Rank and addresses come from Modal's cluster info."""
    import modal
    import modal.experimental

    from modal_rl.cluster.bootstrap import bootstrap

    info = modal.experimental.get_cluster_info()
    addresses = list(getattr(info, "container_ipv4_ips", None) or info.container_ips)
    plan = BootstrapPlan.from_json(plan_json)
    out = _Tee(sys.stdout)
    if info.rank == 0 and forward_dashboard:
        with modal.forward(plan.dashboard_port) as tunnel:
            print(f"[modal_rl.cluster rank 0] Ray dashboard: {tunnel.url}", file=sys.stderr, flush=True)
            code = bootstrap(info.rank, addresses, plan, out=out)
    else:
        code = bootstrap(info.rank, addresses, plan, out=out)
    return {"rank": info.rank, "exit_code": code, "tail": list(out.lines)}


class _Tee:
    """stdout that also keeps the last lines, returned to the caller by rank 0."""

    def __init__(self, stream, keep: int = 200):
        self.stream = stream
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._partial = ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self.lines.extend(done)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class ModalBackend(ClusterBackend):
    name = "modal"
    can_detach = True

    def __init__(self, app_name: str = "modal-rl-cluster", forward_dashboard: bool = True, on_line=None):
        self.app_name = app_name
        self.forward_dashboard = forward_dashboard
        self.on_line = on_line
        self.last_kwargs: dict[str, Any] = {}

    def make_plan(self, spec: ClusterSpec, job: JobRequest) -> BootstrapPlan:
        validate_for_modal(spec)
        # Addresses are filled in inside the containers; every container has its own
        # network namespace, so the default ports are used on every node.
        plan = plan_from(spec, job)
        plan.dashboard_host = "0.0.0.0"  # modal.forward tunnels into the container's port
        return plan

    def build_function(self, spec: ClusterSpec):
        """(app, function) defined offline; records the kwargs in ``last_kwargs``."""
        import modal

        validate_for_modal(spec)
        app = modal.App(self.app_name)
        volumes = {
            path: modal.Volume.from_name(name, create_if_missing=True) for name, path in spec.volumes.items()
        }
        secrets = [modal.Secret.from_name(name) for name in spec.secrets]
        kwargs = function_kwargs(spec)
        self.last_kwargs = {
            **kwargs,
            "cluster_size": spec.nodes,
            "rdma": spec.rdma,
            "volumes": dict(spec.volumes),
        }
        clustered = modal.clustered(size=spec.nodes, rdma=spec.rdma)(container_main)
        fn = app.function(
            image=build_image(spec),
            volumes=volumes,
            secrets=secrets,
            env=dict(spec.env),
            serialized=True,
            **kwargs,
        )(clustered)
        return app, fn

    def describe(self, spec: ClusterSpec, job: JobRequest) -> dict[str, Any]:
        plan = self.make_plan(spec, job)
        _, fn = self.build_function(spec)
        return {
            "backend": self.name,
            "spec": spec.to_dict(),
            "image": spec.image or f"debian_slim(python 3.11) + ray[default]=={RAY_VERSION} + torch",
            "modal_function": {**self.last_kwargs, "inspected": inspect_function(fn)},
            "commands": ["modal_rl.cluster.backend_modal.container_main(plan) on every container"],
            "env": node_environment(plan, "<interface of the cluster address>"),
            "entrypoint": plan.entrypoint,
            "runtime_env": plan.runtime_env,
        }

    def run(self, spec: ClusterSpec, job: JobRequest) -> int:
        plan = self.make_plan(spec, job)
        app, fn = self.build_function(spec)
        with app.run():
            result = fn.remote(plan.to_json(), self.forward_dashboard)
        for line in result.get("tail", []):
            if self.on_line is not None:
                self.on_line(line)
        return int(result["exit_code"])

    def spawn(self, spec: ClusterSpec, job: JobRequest) -> str:
        """--detach: start the cluster in a detached app and return the function call id."""
        plan = self.make_plan(spec, job)
        app, fn = self.build_function(spec)
        with app.run(detach=True):
            call = fn.spawn(plan.to_json(), self.forward_dashboard)
        return call.object_id


def inspect_function(fn) -> dict[str, Any]:
    """What the built function will ask Modal for, read back from the function object.

    GPU, volumes, secrets, cloud and region are on its public-ish ``_spec_``; cluster size,
    RDMA, timeout and retries live only in the loader's closure, read here best-effort
    (``None`` when a Modal release moves them). Offline tests compare both with the flags.
    """
    inner = next((v for k, v in vars(fn).items() if k.startswith("_sync_original")), fn)
    out: dict[str, Any] = {}
    spec = getattr(inner, "_spec_", None)
    if spec is not None:
        out["gpu"] = spec.gpus
        out["volumes"] = {
            str(path): getattr(vol, "_name", None) or repr(vol) for path, vol in spec.volumes.items()
        }
        out["secrets"] = len(spec.secrets)
        out["cloud"] = spec.cloud
    load = getattr(inner, "_load", None)
    cells = {}
    if load is not None and load.__closure__:
        for name, cell in zip(load.__code__.co_freevars, load.__closure__, strict=False):
            try:
                cells[name] = cell.cell_contents
            except ValueError:
                continue
    out["cluster_size"] = cells.get("cluster_size")
    out["rdma"] = cells.get("rdma")
    out["timeout"] = cells.get("timeout")
    policy = cells.get("retry_policy")
    out["retries"] = getattr(policy, "retries", None) if policy is not None else 0
    return out
