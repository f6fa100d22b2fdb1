"""``python -m patches check [--verl [DIR|sdist]] [--slime DIR] [--full] [--jobs N] [--json FILE] [--keep DIR]``.

verl runs when ``--verl`` is given or nothing else is (from its sdist by default); slime runs
when ``--slime DIR`` is given or ``SLIME_PATH`` names a checkout. ``--framework NAME=DIR`` checks any other ``patches/NAME/series.toml``. Exit status
0 when every row is ok, 1 on any deviation, 2 on bad usage (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from patches import check, series_path, stages
from patches.series import SeriesError, load

SLIME_ENV = "SLIME_PATH"


def _targets(args) -> list[tuple[str, str | None]]:
    """verl when ``--verl`` is given or nothing else is; slime when ``--slime`` or $SLIME_PATH is."""
    picked: list[tuple[str, str | None]] = []
    slime = args.slime or os.environ.get(SLIME_ENV) or None
    if args.verl is not None or not (slime or args.framework):
        picked.append(("verl", args.verl or "sdist"))
    if slime:
        picked.append(("slime", slime))
    for item in args.framework:
        name, _, source = item.partition("=")
        picked.append((name, source or None))
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patches", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="apply each series to a clean base and prove every fix")
    p.add_argument(
        "--verl", nargs="?", const="sdist", help="verl base: an unpacked sdist, a .tar.gz, or 'sdist'"
    )
    p.add_argument("--slime", help=f"slime checkout (default ${SLIME_ENV})")
    p.add_argument("--framework", action="append", default=[], metavar="NAME=DIR", help="any other series")
    p.add_argument("--full", action="store_true", help="also run each patch's upstream_tests_full")
    p.add_argument(
        "--jobs",
        type=int,
        help=f"test runs side by side (default ${stages.JOBS_ENV}, else the CPU count, at most "
        f"{stages.MAX_DEFAULT_JOBS})",
    )
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    p.add_argument("--keep", type=Path, help="work in this directory and keep it (for debugging)")
    args = parser.parse_args(argv)
    try:
        jobs = stages.default_jobs() if args.jobs is None else args.jobs
    except ValueError as exc:
        print(f"patches: {exc}", file=sys.stderr)
        return 2
    if jobs < 1:
        print("patches: --jobs must be 1 or more (test runs side by side)", file=sys.stderr)
        return 2
    rows: list[check.Row] = []
    for framework, source in _targets(args):
        path = series_path(framework)
        if not path.is_file():
            print(f"patches: no series for {framework} ({path} is missing)", file=sys.stderr)
            return 2
        try:
            series = load(path)
        except SeriesError as exc:
            print(f"patches: {exc}", file=sys.stderr)
            return 2
        keep = args.keep / framework if args.keep else None
        rows += check.check_series(
            series, source, full=args.full, keep=keep, log=lambda m: print(m, flush=True), jobs=jobs
        )
    print(check.table(rows))
    for row in rows:
        for problem in row.problems:
            print(f"\n[{row.framework} {row.patch}] {problem}")
    if args.json:
        args.json.write_text(json.dumps(check.as_json(rows), indent=2))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
