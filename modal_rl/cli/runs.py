"""``modal-rl status|logs|stop NAME``: follow, inspect and stop a detached Modal run by name.

A launcher's ``--detach`` starts the run in a Modal app named after the run (``--name``, else
``modal-rl-<run id>``) and prints that name. These commands find the app through Modal's own
command line, its public interface (``modal app list --json``), and act on its app id:

- ``status NAME``: the newest app of that name (state, running tasks, created/stopped);
- ``logs NAME``: ``modal app logs --follow <app id>`` (``--no-follow``: what is there now);
- ``stop NAME``: ``modal app stop --yes <app id>``.

``--dry-run`` prints the Modal commands instead of running them (offline; how the tests
check them). A missing ``modal`` is one line with the install command (exit 2); no app of
that name is one line naming the name and ``modal app list`` (exit 2).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from typing import Any

from modal_rl.cli_errors import OneLineParser, UserError, run_main

APP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def modal_cli() -> list[str]:
    """Modal's command line, run by the python this package runs on (not whatever is on PATH)."""
    return [sys.executable, "-m", "modal"]


def list_command() -> list[str]:
    return [*modal_cli(), "app", "list", "--json"]


def action_command(action: str, app_id: str, follow: bool = True) -> list[str]:
    if action == "logs":
        return [*modal_cli(), "app", "logs", *(["--follow"] if follow else []), app_id]
    if action == "stop":
        return [*modal_cli(), "app", "stop", "--yes", app_id]
    raise ValueError(action)


def _field(row: dict[str, Any], name: str) -> Any:
    """A column of ``modal app list --json`` by its snake_case key (older releases used the
    display title, e.g. "App ID")."""
    for key, value in row.items():
        if re.sub(r"[^a-z0-9]+", "_", str(key).lower()).strip("_") == name:
            return value
    return None


def find_app(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The newest app named ``name`` (a running one before a stopped one)."""
    mine = [row for row in rows if _field(row, "description") == name]
    if not mine:
        raise UserError(f"no Modal app named {name!r} in this environment; `modal app list` shows the apps")
    return max(
        mine,
        key=lambda row: (
            str(_field(row, "state")).lower() not in ("stopped", "stopping"),
            str(_field(row, "created_at")),
        ),
    )


def build_parser(action: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=f"modal-rl {action}", description=__doc__.split("\n")[0])
    parser.add_argument("name", help="the run name the launcher printed (its --name)")
    parser.add_argument("--dry-run", action="store_true", help="print the Modal commands; run nothing")
    if action == "logs":
        parser.add_argument("--no-follow", action="store_true", help="print what is there now and return")
    if action == "status":
        parser.add_argument("--json", action="store_true", help="the app's row as JSON")
    return parser


def _run(action: str, argv: list[str]) -> int:
    args = build_parser(action).parse_args(argv)
    if not APP_NAME_RE.match(args.name):
        raise UserError(f"{args.name!r} is not a run name (letters, digits, '.', '_', '-'; at most 64)")
    follow = not getattr(args, "no_follow", False)
    if args.dry_run:
        print(" ".join(list_command()) + f"  # then the newest app described as {args.name!r}")
        if action != "status":
            print(" ".join(action_command(action, "<app id>", follow)))
        return 0
    try:
        import modal  # noqa: F401  (its command line runs in a child; check it is there first)
    except ModuleNotFoundError as exc:
        from modal_rl.cli_errors import missing_extra

        raise UserError(missing_extra(exc) or str(exc)) from None
    from modal_rl.modal_check import check_modal_access

    check_modal_access()
    listed = subprocess.run(list_command(), capture_output=True, text=True)
    if listed.returncode != 0:
        tail = " ".join(listed.stderr.split())[-300:]
        raise UserError(f"`modal app list` failed ({tail}); check `modal token info`", code=1)
    app = find_app(json.loads(listed.stdout or "[]"), args.name)
    app_id = _field(app, "app_id")
    if action == "status":
        if args.json:
            print(json.dumps(app))
        else:
            print(
                f"{args.name}: {_field(app, 'state')}, {_field(app, 'tasks')} running task(s), app {app_id}, "
                f"created {_field(app, 'created_at')}"
                + (f", stopped {_field(app, 'stopped_at')}" if _field(app, "stopped_at") else "")
            )
        return 0
    try:
        return subprocess.run(action_command(action, str(app_id), follow)).returncode
    except BrokenPipeError:
        return 0


def main(action: str, argv: list[str]) -> int:
    return run_main(f"modal-rl {action}", lambda rest: _run(action, rest), argv)
