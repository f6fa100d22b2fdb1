"""Preflight: find the mistakes that would otherwise surface after a queue wait.

Runs before anything is provisioned. Generic checks live here; each framework adapter
hands in validators for its own config (``(spec, framework_argv) -> problems``), e.g. verl's
``trainer.nnodes`` × ``trainer.n_gpus_per_node`` against the spec. All problems are
collected and reported together, so one run of ``--preflight-only`` shows every one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from modal_rl.cluster.plan import BootstrapPlan
from modal_rl.cluster.spec import ClusterSpec

Validator = Callable[[ClusterSpec, list[str]], Iterable[str]]

# Variables the bootstrap owns; a user value would silently break the cluster.
_RESERVED_ENV = {
    "RAY_ADDRESS": "the bootstrap points jobs at its own cluster",
    "CUDA_VISIBLE_DEVICES": "Modal assigns the GPUs of each container",
    "MODAL_RL_RUN_ID": "it tags the processes of one run for teardown",
}


class PreflightError(RuntimeError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"preflight found {len(problems)} problem(s):\n{listing}")


def generic_checks(
    spec: ClusterSpec, plan: BootstrapPlan | None = None, required_gpus: int | None = None
) -> list[str]:
    """Backend-neutral checks; a backend's own limits are checked in its ``make_plan``."""
    problems = []
    total = spec.nodes * spec.gpus_per_node
    if required_gpus is not None and required_gpus > total:
        problems.append(
            f"the job asks for {required_gpus} GPUs but the cluster has {spec.nodes} nodes x "
            f"{spec.gpus_per_node} = {total}"
        )
    for key, why in _RESERVED_ENV.items():
        if key in spec.env:
            problems.append(f"env {key} must not be set: {why}")
    for key, value in spec.env.items():
        if "\n" in value or "\0" in value:
            problems.append(f"env {key}: value contains a newline or NUL byte")
    if plan is not None:
        ports = {"gcs": plan.gcs_port, "dashboard": plan.dashboard_port, "control": plan.control_port}
        for name, port in ports.items():
            if not 1024 <= port <= 65535:
                problems.append(f"{name} port {port} is outside 1024..65535")
        if len(set(ports.values())) != len(ports):
            problems.append(f"ports must be distinct: {ports}")
    mounts = list(spec.volumes.values())
    for path in mounts:
        if any(other != path and other.startswith(path.rstrip("/") + "/") for other in mounts):
            problems.append(f"volume mount {path} contains another mount; Modal cannot nest volume mounts")
    return problems


def run_preflight(
    spec: ClusterSpec,
    framework_argv: list[str] | None = None,
    validators: Iterable[Validator] = (),
    plan: BootstrapPlan | None = None,
    required_gpus: int | None = None,
) -> list[str]:
    """Every problem found; raises ``PreflightError`` listing them all if there is any."""
    problems = generic_checks(spec, plan, required_gpus)
    for validate in validators:
        try:
            problems += [str(p) for p in validate(spec, list(framework_argv or []))]
        except Exception as exc:  # a broken validator is itself a preflight failure
            problems.append(
                f"validator {getattr(validate, '__name__', validate)!r} raised {type(exc).__name__}: {exc}"
            )
    if problems:
        raise PreflightError(problems)
    return problems
