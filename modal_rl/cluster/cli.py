"""Command-line plumbing shared by ``python -m verl_modal`` and ``python -m slime_modal``.

An adapter's ``main`` does::

    ours, framework_argv = split_passthrough(argv)      # everything after `--` is untouched
    parser = argparse.ArgumentParser(...); add_cluster_args(parser); ...
    args = parser.parse_args(ours)
    spec = spec_from_args(args)
    return run_job(spec, entrypoint, runtime_env, backend=args.backend, preflight=[check],
                   framework_argv=framework_argv, **run_options(args))

``run_job`` is the single entry: preflight (always), then ``--dry-run`` (print the plan's
summary, ``--json`` the whole plan), ``--preflight-only`` (stop after preflight), ``--detach`` (Modal only: spawn and
return) or a blocking run whose exit code is the job's.

The run key: ``run_job`` (and each launcher's ``main``, first thing, via ``ensure_run_key``)
puts ``MODAL_RL_RUN_KEY`` into this process's environment unless the user exported one, so
the launcher and everything it starts share it. Whatever we print passes ``redact``.
"""

from __future__ import annotations

import argparse
import json as jsonlib
import sys
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backends import BACKENDS, get_backend
from modal_rl.cluster.local_inputs import LocalInput
from modal_rl.cluster.preflight import PreflightError, Validator, run_preflight
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError, rdma_note
from modal_rl.run_key import ensure_run_key, redact


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(our args, the framework's args): split at the first ``--``, which is dropped."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return list(argv), []


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env {text!r}: expected KEY=VALUE")
    return key, value


def _volume(text: str) -> tuple[str, str]:
    name, sep, path = text.partition(":")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--volume {text!r}: expected NAME:/mount/path")
    return name, path


def add_cluster_args(parser: argparse.ArgumentParser, defaults: ClusterSpec | None = None) -> None:
    """Adds the cluster flags to ``parser`` (in an argument group named 'cluster')."""
    d = defaults or ClusterSpec()
    g = parser.add_argument_group("cluster")
    g.add_argument("--backend", choices=BACKENDS.names(), default="local", help="where the Ray cluster runs")
    g.add_argument("--nodes", type=int, default=d.nodes, help="nodes (Modal containers) in the cluster")
    g.add_argument(
        "--gpu", default=d.gpu, help="GPUs per node, TYPE:COUNT, e.g. H100:8 (Modal: all of a host)"
    )
    g.add_argument(
        "--rdma",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RDMA fabric (Modal; default: on for multi-node H100/H200/B200 clusters)",
    )
    g.add_argument("--image", default=d.image, help="container image (registry tag) for Modal")
    g.add_argument(
        "--volume",
        type=_volume,
        action="append",
        default=[],
        metavar="NAME:PATH",
        help="Modal: mount the Volume NAME at PATH on every node (made if missing; repeat for more; "
        "--backend local ignores it)",
    )
    g.add_argument("--secret", action="append", default=[], metavar="NAME", help="Modal Secret name")
    g.add_argument(
        "--env",
        type=_key_value,
        action="append",
        default=[],
        metavar="K=V",
        help="environment variable for every node and the job's processes (repeat for more)",
    )
    g.add_argument(
        "--join-timeout",
        type=float,
        default=d.join_timeout_s,
        metavar="S",
        help=f"seconds to wait for every node to join the cluster (default {d.join_timeout_s:g})",
    )
    g.add_argument(
        "--job-timeout",
        type=float,
        default=d.job_timeout_s,
        metavar="S",
        help=f"seconds the job may run before it is stopped (default {d.job_timeout_s:g})",
    )
    g.add_argument(
        "--retries",
        type=int,
        default=d.retries,
        metavar="N",
        help=f"restart a run whose cluster lost a node up to N times, on Modal and on local "
        f"clusters (default {d.retries}; docs/reliability.md)",
    )
    g.add_argument("--region", default=d.region, help="Modal: region for the containers, e.g. us-east")
    g.add_argument(
        "--cloud", default=d.cloud, help="Modal: cloud provider for the containers, e.g. aws, gcp, oci"
    )
    g.add_argument(
        "--collective-check", action="store_true", help="all-reduce across all nodes before the job"
    )
    g.add_argument("--detach", action="store_true", help="Modal: start the run and return (it keeps running)")
    g.add_argument(
        "--name",
        default=None,
        type=run_name,
        help="Modal: the run's app name, what `modal-rl status|logs|stop NAME` take (default: "
        "modal-rl-cluster, or modal-rl-<id> with --detach)",
    )
    g.add_argument(
        "--dashboard",
        action="store_true",
        help="Modal: forward Ray's dashboard through a TLS tunnel (token required; the launcher "
        "writes the token to ~/.modal-rl/runs/<run>.token). Default: not reachable from outside",
    )
    g.add_argument("--dry-run", action="store_true", help="print the plan's summary and exit; starts nothing")
    g.add_argument("--json", action="store_true", help="with --dry-run: print the whole plan as JSON")
    g.add_argument("--preflight-only", action="store_true", help="run the checks and exit; starts nothing")


def spec_from_args(args: argparse.Namespace, **overrides: Any) -> ClusterSpec:
    """A ClusterSpec from the parsed flags; raises ClusterSpecError with the flag's problem."""
    volumes: dict[str, str] = {}
    for name, path in args.volume:
        if name in volumes:
            raise ClusterSpecError(f"--volume {name}: given twice")
        volumes[name] = path
    fields = dict(
        nodes=args.nodes,
        gpu=args.gpu,
        rdma=args.rdma,
        image=args.image,
        volumes=volumes,
        secrets=tuple(args.secret),
        env=dict(args.env),
        join_timeout_s=args.join_timeout,
        job_timeout_s=args.job_timeout,
        retries=args.retries,
        region=args.region,
        cloud=args.cloud,
        dashboard=getattr(args, "dashboard", False),
    )
    fields.update(overrides)
    return ClusterSpec(**fields)


def run_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dry_run": args.dry_run,
        "json": getattr(args, "json", False),
        "preflight_only": args.preflight_only,
        "detach": args.detach,
        "collective_check": args.collective_check,
        "name": getattr(args, "name", None),
    }


def run_name(text: str) -> str:
    """``--name``'s check: a Modal app name (letters, digits, '.', '_', '-'; at most 64)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: letters, digits, '.', '_', '-' only, at most 64")
    return text


def run_job(
    spec: ClusterSpec,
    entrypoint: list[str],
    runtime_env: dict[str, Any] | None = None,
    *,
    backend: str = "local",
    preflight: Iterable[Validator] = (),
    framework_argv: list[str] | None = None,
    required_gpus: int | None = None,
    address_env: dict[str, str] | None = None,
    plan_extra: dict[str, Any] | None = None,
    dry_run: bool = False,
    json: bool = False,
    preflight_only: bool = False,
    detach: bool = False,
    collective_check: bool = False,
    name: str | None = None,
    out: TextIO | None = None,
    local_files: Sequence[LocalInput] = (),
    image_steps: Sequence[Any] = (),
    image_recipe: Any = None,
) -> int:
    """Preflight, then plan / run ``entrypoint`` as a Ray job on a ``spec`` cluster.

    ``address_env`` names env vars filled with cluster addresses at bring-up (see
    ``plan.address_env_values``); ``plan_extra`` adds the adapter's own sections to a dry run's
    plan. ``local_files`` (``local_inputs.collect``) travel into the Modal containers at the
    same path and are listed in the plan; the local backend's nodes already see them.
    ``image_steps`` (Modal only): extra build steps of the cluster image (``build_image``);
    ``image_recipe`` (Modal only, ``images.ImageRecipe``): the image when the spec names none. Returns
    the process exit code: 0 for a clean dry run or preflight, 2 for a preflight failure
    (nothing was started), else rank 0's (the job's) exit code.
    """
    out = out or sys.stdout
    key = ensure_run_key()
    job = JobRequest(
        list(entrypoint),
        dict(runtime_env or {}),
        collective_check=collective_check,
        address_env=dict(address_env or {}),
    )
    modal_only = {
        "local_files": tuple(local_files),
        "image_steps": tuple(image_steps),
        "image_recipe": image_recipe,
    }
    if backend == "modal" and (name or detach):
        # A detached run gets a name of its own, so status/logs/stop can find it later.
        modal_only["app_name"] = name or f"modal-rl-{uuid.uuid4().hex[:8]}"
    impl = get_backend(backend, **(modal_only if backend == "modal" else {}))
    if detach and not impl.can_detach:
        print(f"--detach is not available with --backend {impl.name}: {impl.detach_note}", file=sys.stderr)
        return 2
    try:
        plan = impl.make_plan(spec, job)
        run_preflight(spec, framework_argv, preflight, plan=plan, required_gpus=required_gpus)
    except (PreflightError, ClusterSpecError) as exc:
        print(redact(str(exc), key), file=sys.stderr)
        return 2
    note = rdma_note(spec) if backend == "modal" else None
    if note:
        print(f"modal_rl.cluster: {note}", file=sys.stderr)
    if dry_run:
        description = impl.describe(spec, job)
        description["framework_argv"] = list(framework_argv or [])
        description["preflight"] = "ok"
        description.update(plan_extra or {})
        # The plan holds no key by construction; redact anyway, in case a user put it in argv.
        if json:
            out.write(redact(jsonlib.dumps(description, indent=2, default=str), key) + "\n")
        else:
            from modal_rl.cluster.summary import render

            out.write(redact(render(jsonlib.loads(jsonlib.dumps(description, default=str))), key))
        return 0
    if preflight_only:
        print("preflight ok", file=sys.stderr)
        return 0
    if detach:
        call_id = impl.spawn(spec, job)
        run = modal_only["app_name"]
        out.write(jsonlib.dumps({"detached": True, "name": run, "function_call_id": call_id}) + "\n")
        print(
            f"modal_rl.cluster: detached run {run}: follow with `modal-rl logs {run}`, "
            f"check with `modal-rl status {run}`, stop with `modal-rl stop {run}`",
            file=sys.stderr,
        )
        return 0
    return impl.run(spec, job)
