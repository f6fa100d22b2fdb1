"""``python -m modal_rl.report RUN_DIR``: write (or rewrite) the run's ``report.html``.

Prints the report's path; exit 2 with one line when RUN_DIR is not a run folder."""

from __future__ import annotations

import sys
from pathlib import Path


def _main(argv: list[str]) -> int:
    from modal_rl.cli_errors import OneLineParser, UserError, add_debug_flag
    from modal_rl.report.page import write
    from modal_rl.report.run_dir import RunDirError

    parser = OneLineParser(
        prog="python -m modal_rl.report",
        description="Write a run folder's static HTML report (report.html, no network needed to view it).",
    )
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="the run's folder (holds metrics.jsonl)"
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    try:
        out = write(args.run_dir)
    except RunDirError as exc:
        raise UserError(str(exc)) from None
    print(out.resolve())
    return 0


def main(argv: list[str] | None = None) -> int:
    from modal_rl.cli_errors import run_main

    return run_main("modal_rl.report", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
