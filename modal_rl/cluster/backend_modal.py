"""Modal backend: one clustered Modal Function whose N containers run the bootstrap.

``build_function`` defines a ``modal.App`` with one function, decorated
``@app.function(gpu=..., image=..., volumes=..., secrets=..., timeout=..., retries=...)``
over ``@modal.clustered(size=N, rdma=...)``. Calling it with the plan JSON broadcasts the
input to every container; each reads its rank and the cluster's addresses from
``modal.experimental.get_cluster_info()`` (IPv4 when Modal gives them, since Ray's IPv6
support is the younger path) and runs ``bootstrap``; rank 0 returns ``{"exit_code", "tail"}``,
which Modal hands back (only rank 0's output is returned for clustered functions).

Trust boundary (invariants):
- Ray runs with token auth (``RAY_AUTH_MODE=token``); the token is derived from the run key
  (``run_key.ray_token``: no engine holds it); both reach
  the containers only in a Modal Secret made for the run (``run_key.modal_secret``), never in
  the plan JSON (the function's argument) or the function's ``env``;
- the dashboard (which serves Ray's Job API: code execution on every node) leaves the
  container only with ``--dashboard``, through a TLS tunnel, and then still demands the
  token; the launcher writes the token to a 0600 file and prints only its path.

Nothing here contacts Modal until ``run``; ``build_function`` works offline, which is how
the function's settings are tested without a server.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modal_rl.adapters import shipped_packages
from modal_rl.cluster.backend import ClusterBackend, JobRequest, plan_from
from modal_rl.cluster.local_inputs import LocalInput
from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.raynode import node_environment
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError
from modal_rl.modal_calls import (
    attach_local,
    define_function,
    image_local_files,
    inspect_function,
    secret_from_name,
)
from modal_rl.modal_limits import MAX_MODAL_TIMEOUT_S
from modal_rl.run_key import (
    RAY_TOKEN_ENV,
    REDACTED,
    RUN_KEY_ENV,
    ensure_run_key,
    modal_secret,
    ray_token,
    redact,
)

RAY_VERSION = "2.60.0"

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


# One extra image build step: takes a modal.Image, returns the extended one.
ImageStep = Callable[[Any], Any]


def build_image(spec: ClusterSpec, extra_steps: Sequence[ImageStep] = (), recipe=None):
    """The user's registry image, or Debian slim with Ray and torch, then ``extra_steps``
    (each ``image -> image``, in order: an adapter's build steps, e.g. slime's patch series),
    plus this project's packages as source. A registry image keeps its own Python: framework
    images (verl's, slime's) carry the framework, torch and Ray in it, and a second
    interpreter would not. The sources are mounted last: Modal runs no build step on top of
    a mount layer, so every extra step comes before them. ``recipe`` (an
    ``images.ImageRecipe``, used when the spec names no image): the framework at the
    launcher's installed version on a CUDA base."""
    import modal

    if recipe is not None and not spec.image:
        image = recipe.build()
    elif spec.image:
        image = modal.Image.from_registry(spec.image)
    else:
        image = modal.Image.debian_slim(python_version="3.11").pip_install(
            f"ray[default]=={RAY_VERSION}", "torch"
        )
    for step in extra_steps:
        image = step(image)
    # the core and every declared adapter (they import their framework lazily: unused ones cost nothing)
    return image.add_local_python_source(*shipped_packages())


def with_local_files(image, local_files: Sequence[LocalInput]):
    """``image`` plus the job's local input files at their own paths, attached at container
    start (``copy=False``: a changed config needs no image rebuild; mount layers come last)."""
    for item in local_files:
        image = attach_local(image, item.path, item.path, is_dir=item.is_dir)
    return image


RUN_SECRET_NOTE = f"run secret ({RUN_KEY_ENV}, {RAY_TOKEN_ENV}): made for this run"
TOKEN_DIR = "~/.modal-rl/runs"


def forwards_dashboard(plan: BootstrapPlan, rank: int) -> bool:
    """Whether this container opens a tunnel to the dashboard: rank 0, and only on request."""
    return rank == 0 and plan.dashboard


def container_main(plan_json: str) -> dict:
    """Body of every container. Rank and addresses come from Modal's cluster info."""
    import modal
    import modal.experimental

    from modal_rl.cluster.bootstrap import bootstrap
    from modal_rl.cluster.retries import raise_for_retry

    info = modal.experimental.get_cluster_info()
    addresses = list(getattr(info, "container_ipv4_ips", None) or info.container_ips)
    plan = BootstrapPlan.from_json(plan_json)
    out = _Tee(sys.stdout)
    if forwards_dashboard(plan, info.rank):
        # TLS tunnel (unencrypted=False): the token in each request never crosses in the clear.
        with modal.forward(plan.dashboard_port, unencrypted=False) as tunnel:
            print(
                f"[modal_rl.cluster rank 0] Ray dashboard (token required): {tunnel.url}",
                file=sys.stderr,
                flush=True,
            )
            code = bootstrap(info.rank, addresses, plan, out=out)
    else:
        code = bootstrap(info.rank, addresses, plan, out=out)
    if info.rank == 0:
        # A lost follower is an exit code at rank 0, which Modal would count as a success;
        # raising lets the function's retries bring the whole cluster back.
        raise_for_retry(code, plan.retries)
    return {"rank": info.rank, "exit_code": code, "tail": [redact(line) for line in out.lines]}


def write_token_file(run_id: str, key: str, root: str = TOKEN_DIR) -> Path:
    """``<root>/<run_id>.token`` holding ``key``, readable by this user only (0600 in a 0700
    directory); the path is what the launcher prints, never the key."""
    directory = Path(os.path.expanduser(root))
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{run_id}.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key)
    return path


def dashboard_note(path: Path) -> str:
    return (
        f"[modal_rl.cluster] --dashboard: rank 0 prints the dashboard's https URL once it is up; "
        f"it needs the run's token, in {path} (this user only). Use it as "
        f'`curl -H "Authorization: Bearer $(cat {path})" URL/api/jobs/`, or paste it into the '
        "dashboard's token prompt in a browser"
    )


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

    def __init__(
        self,
        app_name: str = "modal-rl-cluster",
        on_line=None,
        on_err=None,
        local_files: Sequence[LocalInput] = (),
        image_steps: Sequence[ImageStep] = (),
        image_recipe=None,
    ):
        self.app_name = app_name
        self.image_recipe = image_recipe  # images.ImageRecipe: the image when the spec names none
        self.local_files = tuple(local_files)  # the job's local inputs, shipped at their paths
        self.image_steps = tuple(image_steps)  # build_image's extra_steps
        self.last_image = None
        self.on_line = on_line
        self.on_err = on_err or (lambda line: print(line, file=sys.stderr, flush=True))
        self.last_kwargs: dict[str, Any] = {}

    def make_plan(self, spec: ClusterSpec, job: JobRequest) -> BootstrapPlan:
        validate_for_modal(spec)
        # Addresses are filled in inside the containers; every container has its own
        # network namespace, so the default ports are used on every node.
        plan = plan_from(spec, job, ray_auth="token")
        # modal.forward tunnels into the container's port on every interface; without the
        # tunnel the dashboard listens on the head's cluster address only (None).
        plan.dashboard_host = "0.0.0.0" if plan.dashboard else None
        return plan

    def build_function(self, spec: ClusterSpec, key: str | None = None):
        """(app, function) defined offline; records the kwargs in ``last_kwargs``.

        The run's key (``key``, default: the run's, made if missing) is attached as a Modal
        Secret made for this run, after the user's named secrets (so theirs cannot replace it).
        """
        import modal

        validate_for_modal(spec)
        app = modal.App(self.app_name)
        secrets = [secret_from_name(name) for name in spec.secrets]
        secrets.append(modal_secret(key if key is not None else ensure_run_key()))
        kwargs = function_kwargs(spec)
        self.last_kwargs = {
            **kwargs,
            "cluster_size": spec.nodes,
            "rdma": spec.rdma,
            "volumes": dict(spec.volumes),
            "secrets": [*spec.secrets, RUN_SECRET_NOTE],
        }
        image = with_local_files(build_image(spec, self.image_steps, self.image_recipe), self.local_files)
        self.last_image = image
        try:
            fn = define_function(
                app,
                container_main,
                image=image,
                volumes=spec.volumes,
                secrets=secrets,
                env=spec.env,
                cluster_size=spec.nodes,
                rdma=spec.rdma,
                **kwargs,
            )
        except modal.exception.InvalidError as exc:
            # Modal's own refusal of a setting the spec passed (a mount point, a GPU string):
            # bad input, named in one line.
            raise ClusterSpecError(f"Modal refuses this cluster: {' '.join(str(exc).split())}") from None
        return app, fn

    def describe(self, spec: ClusterSpec, job: JobRequest) -> dict[str, Any]:
        plan = self.make_plan(spec, job)
        _, fn = self.build_function(spec)
        return {
            "backend": self.name,
            "app": self.app_name,
            "spec": spec.to_dict(),
            "image": self.image_description(spec),
            "modal_function": {**self.last_kwargs, "inspected": inspect_function(fn)},
            "local_files": {
                "what": "local inputs the job names, attached to every container at the same path",
                "files": [item.to_dict() for item in self.local_files],
                "total_bytes": sum(item.bytes for item in self.local_files),
                "inspected": image_local_files(self.last_image),
            },
            "packages": list(shipped_packages()),
            "commands": ["modal_rl.cluster.backend_modal.container_main(plan) on every container"],
            "env": {
                **node_environment(plan, "<interface of the cluster address>"),
                RUN_KEY_ENV: f"{REDACTED} (run secret)",
                RAY_TOKEN_ENV: f"{REDACTED} (run secret)",
            },
            "ray_auth": plan.ray_auth,
            "dashboard": "tls tunnel, token required" if plan.dashboard else "off",
            "entrypoint": plan.entrypoint,
            "runtime_env": plan.runtime_env,
        }

    def image_description(self, spec: ClusterSpec):
        if spec.image:
            return spec.image
        if self.image_recipe is not None:
            return self.image_recipe.describe()
        return f"debian_slim(python 3.11) + ray[default]=={RAY_VERSION} + torch"

    def _announce(self, plan: BootstrapPlan) -> None:
        if plan.dashboard:
            self.on_err(dashboard_note(write_token_file(plan.run_id, ray_token(ensure_run_key()))))

    def run(self, spec: ClusterSpec, job: JobRequest) -> int:
        plan = self.make_plan(spec, job)
        app, fn = self.build_function(spec)
        self._announce(plan)
        with app.run():
            result = fn.remote(plan.to_json())
        for line in result.get("tail", []):
            if self.on_line is not None:
                self.on_line(redact(line))
        return int(result["exit_code"])

    def spawn(self, spec: ClusterSpec, job: JobRequest) -> str:
        """--detach: start the cluster in a detached app and return the function call id."""
        plan = self.make_plan(spec, job)
        app, fn = self.build_function(spec)
        self._announce(plan)
        with app.run(detach=True):
            call = fn.spawn(plan.to_json())
        return call.object_id
