"""Run a Python module with the run's key added to its flags, without the key on a command line.

``python -m modal_rl.engines.keyed_launch --key-flag=--api-key --key-flag=--admin-api-key
sglang.launch_server --model-path ...`` reads the engine bearer from ``MODAL_RL_ENGINE_BEARER``
(an engine holds that, never the run key; ``run_key.engine_bearer``), appends
``--api-key <bearer> --admin-api-key <bearer>`` to ``sys.argv`` inside this process and runs
``sglang.launch_server`` as ``__main__`` (``runpy.run_module``), in this same process.

Why in-process: a server that takes its key only as a flag (SGLang has ``--api-key`` /
``--admin-api-key`` and no environment variable for either) would show it to anyone who can
read ``ps`` or ``/proc/<pid>/cmdline``. The kernel's copy of a process's argv is fixed at
``exec``; changing Python's ``sys.argv`` afterwards does not touch it, so ``ps`` keeps showing
the command above, without the key.

``--guard=sglang`` also puts modal_rl's route guard in front of SGLang's HTTP app, in this
process before the module runs (``auth.install_sglang_guard``): SGLang's keys open every route, the
guard only those the run uses, and the weight routes only for paths under the directories in
``MODAL_RL_SGLANG_WEIGHT_DIRS`` (``sglang_paths``). A launch whose flags would serve without the
guard, or whose weight directories are unusable, stops (exit 2).

Invariants:
- the key is never printed by this module, nor put in an error message. The module it runs
  may print it: SGLang logs ``server_args=ServerArgs(..., api_key=..., admin_api_key=...)`` at
  start, so whatever reads its output must redact (the engine pools do: every line they write
  or relay goes through ``redaction.Redactor``, in ``pool_local.pump``);
- a missing key, or a key flag that is already on the command line, stops the launch with one
  line naming the fix (exit 2) before the module is imported;
- with no ``--key-flag`` the module runs unchanged (only useful for tests and dry runs).
"""

from __future__ import annotations

import runpy
import sys

from modal_rl.engines import sglang_paths, sglang_routes
from modal_rl.run_key import MissingRunKeyError, engine_bearer_from_env

USAGE = (
    "usage: python -m modal_rl.engines.keyed_launch [--key-flag=FLAG]... [--guard=sglang] MODULE [ARGS...]"
)
PREFIX = "--key-flag="
GUARD_PREFIX = "--guard="


def split_argv(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``(key flags, module, module args)`` from our argv; ValueError says what is wrong."""
    flags, guard, module, args = parse_argv(argv)
    return flags, module, args


def parse_argv(argv: list[str]) -> tuple[list[str], str | None, str, list[str]]:
    """``(key flags, guard or None, module, module args)``; ValueError says what is wrong."""
    flags: list[str] = []
    guard = None
    rest = list(argv)
    while rest and rest[0].startswith((PREFIX, GUARD_PREFIX)):
        word = rest.pop(0)
        if word.startswith(GUARD_PREFIX):
            guard = word[len(GUARD_PREFIX) :]
            if guard != sglang_routes.GUARD:
                raise ValueError(f"{word!r}: the one guard is --guard={sglang_routes.GUARD}")
            continue
        flag = word[len(PREFIX) :]
        if not flag.startswith("--") or "=" in flag:
            raise ValueError(f"--key-flag={flag!r}: give a long flag such as --api-key")
        flags.append(flag)
    if not rest or rest[0].startswith("-"):
        raise ValueError(f"no module to run; {USAGE}")
    module, args = rest[0], rest[1:]
    for flag in flags:
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise ValueError(f"{flag} is set by keyed_launch from the run's key; drop it from the command")
    if guard is not None and (why := sglang_routes.refusal(args)):
        raise ValueError(why)
    return flags, guard, module, args


def keyed_args(flags: list[str], args: list[str], key: str) -> list[str]:
    """``args`` with ``FLAG=key`` appended for each key flag (last wins in argparse anyway).
    One word, not two: argparse reads a separate value that starts with ``-`` (a URL-safe key
    does, 1 time in 32) as a flag and stops the server with "expected one argument"."""
    return [*args, *(f"{flag}={key}" for flag in flags)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        flags, guard, module, args = parse_argv(argv)
        key = engine_bearer_from_env() if flags or guard else ""
        if guard is not None:  # the guard's weight directories, checked before SGLang's slow import
            sglang_paths.WeightDirs.from_env().resolved()
    except (ValueError, MissingRunKeyError) as exc:
        print(f"keyed_launch: {exc}", file=sys.stderr)
        return 2
    if guard is not None:
        from modal_rl.engines.auth import install_sglang_guard

        install_sglang_guard()  # before the module's server starts: it serves this app object
    sys.argv = [module, *keyed_args(flags, args, key)]
    # alter_sys: the module sees itself as __main__ with sys.argv[0] set to its file, as `-m` does.
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
