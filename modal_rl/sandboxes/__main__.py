"""``python -m modal_rl.sandboxes sweep --tag KEY=VALUE ...``: terminate orphaned sandboxes.

Local: every sandbox in this user's registry (``live_records.default_dir``) whose tags include all
given tags, by process group, only if the entry's group is its leader's own and the leader's
start time matches; any other matching entry is refused, not killed, and printed as
``refused <id>: <reason>``. A registry dir that is not private to the user is refused (exit 2).
Modal: ``modal.Sandbox.list(tags=...)`` + terminate,
after checking the credentials and the route to Modal (``modal_rl.modal_check``). Failures
are one line (exit 2 bad input, 1 failed, 130 Ctrl-C; ``--debug`` adds the traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def _tag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(f"tags are KEY=VALUE (e.g. modal-rl-run=run-123), got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    from modal_rl.cli_errors import run_main

    return run_main("modal_rl.sandboxes", _main, argv)


def build_parser() -> argparse.ArgumentParser:
    from modal_rl.cli_errors import OneLineParser, add_debug_flag

    parser = OneLineParser(prog="python -m modal_rl.sandboxes")
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser("sweep", help="terminate every sandbox carrying all the given tags")
    sweep.add_argument(
        "--tag", type=_tag, action="append", required=True, help="KEY=VALUE; repeat to AND tags"
    )
    sweep.add_argument("--provider", choices=("local", "modal"), default="local")
    sweep.add_argument(
        "--registry", type=Path, default=None, help="local registry dir (default: this user's)"
    )
    sweep.add_argument("--app", default=None, help="Modal app name (modal provider)")
    add_debug_flag(sweep)
    return parser


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    tags = dict(args.tag)
    if args.provider == "local":
        from modal_rl.cli_errors import UserError
        from modal_rl.sandboxes import live_records

        try:
            result = live_records.sweep_report(args.registry or live_records.default_dir(), tags)
        except live_records.RegistryRefusedError as exc:
            raise UserError(str(exc)) from None
        count = result.killed
        refused = [f"refused {r.id}: {r.reason}" for r in result.refused]
    else:
        from modal_rl.modal_check import check_modal_access
        from modal_rl.sandboxes.modal_provider import ModalProvider

        check_modal_access(offline_hint="--provider local")  # one line, before the first call
        provider = ModalProvider(app_name=args.app) if args.app else ModalProvider()
        count, refused = asyncio.run(provider.sweep(tags)), []
    print(f"swept {count} sandbox(es) tagged {tags}")
    for line in refused:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
