"""``modal-rl <command> ...``: one console command over every launcher and tool.

Each subcommand hands its arguments, unchanged, to the entry point it names; the ``python -m``
forms stay the same programs. Imports are lazy: ``modal-rl --version`` and ``--help`` load no
framework, and a command whose extra is not installed says in one line which one to install
(exit 2, :func:`modal_rl.cli_errors.missing_extra`).

Invariant: the table below is the only list of commands; ``--help`` and dispatch read it.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

PROG = "modal-rl"


@dataclass(frozen=True)
class Command:
    module: str  # the module whose ``main(argv) -> int`` runs the command
    summary: str
    python_m: str  # the equivalent ``python -m`` form


COMMANDS: dict[str, Command] = {
    "verl": Command(
        "verl_modal.__main__", "run verl's PPO trainer, locally or on a Modal cluster", "verl_modal"
    ),
    "slime": Command(
        "slime_modal.__main__", "run slime's trainer, locally or on a Modal cluster", "slime_modal"
    ),
    "cluster": Command(
        "modal_rl.cluster.__main__", "a Ray cluster for any command (smoke, run)", "modal_rl.cluster"
    ),
    "sandboxes": Command(
        "modal_rl.sandboxes.__main__", "score code in a pool of isolated sandboxes", "modal_rl.sandboxes"
    ),
    "weightsync": Command(
        "modal_rl.weightsync.cli.commands", "encode, apply, inspect weight-sync frames", "modal_rl.weightsync"
    ),
    "report": Command("modal_rl.report.__main__", "write a run's HTML report", "modal_rl.report"),
    "bench": Command("benchmarks.__main__", "run a benchmark suite (from a checkout)", "benchmarks"),
    "status": Command("modal_rl.cli.runs", "state of a detached Modal run, by run name", "modal_rl status"),
    "logs": Command("modal_rl.cli.runs", "follow a detached Modal run's logs", "modal_rl logs"),
    "stop": Command("modal_rl.cli.runs", "stop a detached Modal run", "modal_rl stop"),
}
RUN_COMMANDS = ("status", "logs", "stop")


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("modal-rl")
    except Exception:  # running from a checkout that was never installed
        from modal_rl import __version__

        return __version__


def usage() -> str:
    width = max(map(len, COMMANDS))
    summary = max(len(cmd.summary) for cmd in COMMANDS.values())
    rows = "\n".join(
        f"  {name:<{width}}  {cmd.summary:<{summary}}  (python -m {cmd.python_m})"
        for name, cmd in COMMANDS.items()
    )
    return (
        f"usage: {PROG} [--version] <command> [args...]\n\n"
        f"Modal infrastructure for slime and verl RL post-training.\n\ncommands:\n{rows}\n\n"
        f"`{PROG} <command> --help` shows a command's flags.\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"{PROG} {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        sys.stderr.write(
            f"{PROG}: unknown command {name!r}; one of: {', '.join(COMMANDS)} (see {PROG} --help)\n"
        )
        return 2
    from modal_rl.cli_errors import missing_extra

    if name == "bench":
        _find_checkout_benchmarks()
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        line = missing_extra(exc)
        if line is None and name == "bench" and exc.name == "benchmarks":
            line = (
                "the benchmark suites ship with a modal-rl checkout, not the wheel: clone the repository, "
                "`pip install -e '.[bench]'` there, and run `modal-rl bench` from it"
            )
        if line is None:
            raise
        sys.stderr.write(f"{PROG} {name}: {line}\n")
        return 2
    if name in RUN_COMMANDS:
        return int(module.main(name, rest) or 0)
    return int(module.main(rest) or 0)


def _find_checkout_benchmarks() -> None:
    """Make ``benchmarks`` importable from the checkout this package runs from (an editable
    install) or the current directory, when either holds it: a console script's path has
    neither."""
    from pathlib import Path

    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "benchmarks" / "__main__.py").is_file():
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            return


def entry() -> None:
    """The console script's target: exit with :func:`main`'s status."""
    sys.exit(main())
