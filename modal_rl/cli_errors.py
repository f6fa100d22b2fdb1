"""One place where the launchers turn failures into one line and an exit code.

Every entry point (``python -m verl_modal``, ``slime_modal``, ``modal_rl.cluster``,
``modal_rl.sandboxes``) runs its ``main`` through :func:`run_main`, so a user sees the same
contract everywhere:

- exit 2 and one line for bad input or configuration (:class:`UserError`, argparse's own
  errors through :class:`OneLineParser`, Modal refusing the credentials);
- exit 1 and one line for a run that failed (:class:`RunFailed`, or any other exception,
  named by type and message);
- exit 130 and one line on Ctrl-C (whatever the run started is stopped by the context
  managers and ``finally`` blocks the interrupt unwinds through);
- ``--debug`` (anywhere before ``--``) or ``MODAL_RL_DEBUG=1`` adds the traceback.

Invariant: every line printed here passes ``run_key.redact``; nothing here imports a
framework (cheap enough for the fast-failure paths).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
DEBUG_FLAG = "--debug"
DEBUG_ENV = "MODAL_RL_DEBUG"


class UserError(Exception):
    """Bad input or configuration: the message is one line naming the cause and the fix."""

    code = EXIT_BAD_INPUT

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class RunFailed(UserError):
    """The input was fine but the run could not be done (exit 1); the message is one line."""

    code = EXIT_FAILED


class OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line (``prog: message; see prog --help``)
    instead of the usage block plus the error; subparsers inherit the class."""

    def error(self, message: str):
        name = self.prog.removeprefix("python -m ").split()[0]  # run_main's prefix
        self.exit(EXIT_BAD_INPUT, f"{name}: {message} (see {self.prog} --help)\n")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        DEBUG_FLAG, action="store_true", help="on failure, print the traceback too (also MODAL_RL_DEBUG=1)"
    )


def wants_debug(argv: list[str]) -> bool:
    ours = argv[: argv.index("--")] if "--" in argv else argv
    return DEBUG_FLAG in ours or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def remote_cause(exc: BaseException) -> BaseException:
    """Ray's ``RayTaskError(X)`` (its text: the remote traceback) unwrapped to ``X``, however
    deeply nested; any other exception as it is."""
    while type(exc).__name__.startswith("RayTaskError") and isinstance(
        getattr(exc, "cause", None), BaseException
    ):
        exc = exc.cause
    return exc


# The extra of pyproject.toml that brings each optional top-level module (what a missing
# import tells the user to install). Torch is the user's build to choose (CPU or CUDA).
EXTRA_OF_MODULE = {
    "modal": "modal",
    "synchronicity": "modal",
    "grpclib": "modal",
    "ray": "local",
    "aiohttp": "local",
    "yarl": "local",
    "verl": "verl",
    "hydra": "verl",
    "omegaconf": "verl",
    "pandas": "verl",
    "tensordict": "verl",
    "transformers": "verl",
    "tokenizers": "verl",
    "tensorboard": "verl",
    "matplotlib": "verl",
    "pytest": "verl",
    "peft": "bench",
}
OWN_PACKAGES = ("modal_rl", "verl_modal", "slime_modal", "benchmarks", "patches")


def missing_extra(exc: BaseException) -> str | None:
    """One line naming the missing module and the install command that brings it, for a
    ``ModuleNotFoundError`` of an optional dependency; ``None`` for anything else (a module
    of this project itself missing is a broken install, not a missing extra)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if top in OWN_PACKAGES:
        return None
    if top == "torch":
        how = "pip install torch (the CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    elif top in ("slime", "sglang", "megatron"):
        how = "bash scripts/install_slime_cpu.sh in a modal-rl checkout (docs/quickstart-slime.md), or SLIME_PATH"
    elif top in EXTRA_OF_MODULE:
        how = f"pip install 'modal-rl[{EXTRA_OF_MODULE[top]}]'"
    else:
        how = f"pip install {top}"
    return f"this command needs the Python module {top!r}, which is not installed; install it with: {how}"


def describe(exc: BaseException) -> tuple[str, int]:
    """``(line, exit code)`` for an exception that reached the top of a launcher."""
    if isinstance(exc, UserError):
        return one_line(str(exc)), exc.code
    missing = missing_extra(exc)
    if missing is not None:
        return missing, EXIT_BAD_INPUT
    if remote_cause(exc) is not exc:
        return describe(remote_cause(exc))
    kind = type(exc)
    from_modal = kind.__module__.split(".")[0] == "modal"
    from modal_rl.cluster.spec import ClusterSpecError

    if isinstance(exc, ClusterSpecError):
        return one_line(str(exc)), EXIT_BAD_INPUT
    if from_modal and kind.__name__ == "InvalidError":
        # Modal validates volumes, mounts and GPU strings when the function is defined: bad input.
        return f"Modal refuses this setting: {one_line(str(exc), 300)}", EXIT_BAD_INPUT
    if from_modal and kind.__name__ == "AuthError":
        return (
            f"Modal refused the credentials ({one_line(str(exc), 200)}); run `modal token new` or "
            "export MODAL_TOKEN_ID and MODAL_TOKEN_SECRET of a valid token",
            EXIT_BAD_INPUT,
        )
    if from_modal and kind.__name__ in ("ConnectionError", "TimeoutError"):
        return (
            f"lost the connection to Modal ({one_line(str(exc), 200)}); check the network and retry",
            EXIT_FAILED,
        )
    message = one_line(str(exc)) or "(no message)"
    return (
        f"failed: {kind.__name__}: {message} (rerun with {DEBUG_FLAG} for the traceback)",
        EXIT_FAILED,
    )


def run_main(prog: str, main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """``main(argv)``'s exit code, with every failure as one line on stderr (module doc)."""
    from modal_rl.run_key import redact

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = wants_debug(argv)
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt:
        if debug:
            import traceback

            traceback.print_exc()
        _say(prog, "interrupted (Ctrl-C); everything this run started was stopped", redact)
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:
        if debug:
            import traceback

            traceback.print_exc()
        line, code = describe(exc)
        _say(prog, line, redact)
        return code


def _say(prog: str, line: str, redact) -> None:
    try:
        sys.stderr.write(redact(f"{prog}: {line}") + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed (a pipe that went away): nothing to tell
        pass
