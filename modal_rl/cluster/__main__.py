"""``python -m modal_rl.cluster smoke|run ...``: the cluster layer's own launcher.

- ``smoke [--backend local|modal] [--nodes N] [--gpu T:C]``: bring a cluster up, all-reduce
  across it, tear it down (one JSON line on stdout);
- ``run [cluster flags] -- COMMAND...``: run any command as the Ray job of a cluster (the
  same ``run_job`` the verl and slime launchers use; ``--dry-run`` prints the plan).

Either way the run key is made first (unless exported), so every process of the run has it.
Failures are one line (exit 2: bad flags or no Modal credentials; 1: the run failed; 130:
Ctrl-C; ``--debug`` adds the traceback); ``--backend modal`` checks the credentials and the
route to Modal before anything else (``modal_rl.modal_check``).
"""

from __future__ import annotations

import argparse
import json
import sys

from modal_rl.cluster.backends import BACKENDS
from modal_rl.cluster.spec import ClusterSpec, ClusterSpecError


def main(argv: list[str] | None = None) -> int:
    from modal_rl.cli_errors import run_main

    return run_main("modal_rl.cluster", _main, argv)


def build_parser() -> argparse.ArgumentParser:
    from modal_rl.cli_errors import OneLineParser, add_debug_flag
    from modal_rl.cluster.cli import add_cluster_args

    parser = OneLineParser(prog="python -m modal_rl.cluster")
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    smoke = sub.add_parser("smoke", help="bring up a cluster, all-reduce across its nodes, tear down")
    smoke.add_argument("--backend", choices=BACKENDS.names(), default="local")
    smoke.add_argument("--nodes", type=int, default=2)
    smoke.add_argument("--gpu", default=None, help="per node, e.g. H100:8 (required for --backend modal)")
    smoke.add_argument("--rdma", action=argparse.BooleanOptionalAction, default=False)
    smoke.add_argument(
        "--join-timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="seconds to wait for every node to join (default 180)",
    )
    add_debug_flag(smoke)
    run = sub.add_parser(
        "run",
        help="run COMMAND (after --) as the Ray job of a cluster",
        usage="%(prog)s [cluster flags] -- COMMAND [ARGS...]",
    )
    add_cluster_args(run)
    add_debug_flag(run)
    return parser


def _main(argv: list[str]) -> int:
    from modal_rl.cli_errors import UserError
    from modal_rl.cluster.cli import run_job, run_options, spec_from_args, split_passthrough
    from modal_rl.run_key import ensure_run_key

    ensure_run_key()  # before any node starts: every process of the run inherits it
    ours, command = split_passthrough(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    talks_to_modal = args.backend == "modal" and not (
        getattr(args, "dry_run", False) or getattr(args, "preflight_only", False)
    )
    if args.command == "run":
        if not command:
            parser.error("run: give the job's command after --, e.g. -- python3 train.py")
        try:
            spec = spec_from_args(args)
        except ClusterSpecError as exc:
            raise UserError(str(exc)) from None
        if talks_to_modal:
            from modal_rl.modal_check import check_modal_access

            check_modal_access()
        return run_job(spec, command, backend=args.backend, framework_argv=command, **run_options(args))
    try:
        spec = ClusterSpec(
            nodes=args.nodes,
            gpu=args.gpu,
            rdma=args.rdma,
            join_timeout_s=args.join_timeout,
            job_timeout_s=600,
        )
        if args.backend == "modal":
            from modal_rl.cluster.backend_modal import validate_for_modal

            validate_for_modal(spec)
    except ClusterSpecError as exc:
        raise UserError(str(exc)) from None
    if talks_to_modal:
        from modal_rl.modal_check import check_modal_access

        check_modal_access()
    from modal_rl.cluster.smoke import run_smoke

    report = run_smoke(spec, args.backend)
    print(json.dumps(report), flush=True)
    ok = (
        report.get("allreduce_ok")
        and report.get("nodes_alive") == args.nodes
        and not report.get("leftover_pids")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
