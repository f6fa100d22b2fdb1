"""What every weight-sync command shares: one-line errors with their exit codes, the output
check, and the key flag. The commands (``cli``, ``receive``) import this, not each other.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from modal_rl.run_key import MissingRunKeyError
from modal_rl.weightsync.wire.auth import FROM_ENV, FrameKeys, frame_keys

BAD_INPUT, FAILED = 2, 1


class CliError(Exception):
    """A user-facing failure: printed as one line; exit code ``code`` (bad input: 2)."""

    def __init__(self, message: str, code: int = BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


def check_out(out: Path) -> None:
    """Refuse an output whose directory does not exist (before any work is done)."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"{out}: directory {parent} does not exist; create it first or choose another --out")
    if out.is_dir():
        raise CliError(f"{out} is a directory; --out names a file")


def keys_of(args: argparse.Namespace) -> FrameKeys | None:
    """The run's frame keys from the environment, or None with ``--keyless``."""
    if args.keyless:
        return None
    try:
        return frame_keys(FROM_ENV)
    except MissingRunKeyError as exc:
        raise MissingRunKeyError(f"{exc}; or pass --keyless for unsigned frames") from None


def add_key_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keyless",
        action="store_true",
        help="unsigned frames (default: sign/verify with the run key in MODAL_RL_RUN_KEY)",
    )
