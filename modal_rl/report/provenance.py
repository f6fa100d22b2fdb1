"""What a run was: its command line, the code's git commit, the package versions, and how
it ended (wall time, exit status), for the run report's first table.

The launcher records the start (:func:`started`) into ``run.json`` before the framework
runs and the end (:func:`ended`) after it, whatever the outcome; the report shows both.

Invariants: nothing here raises for a missing tool or package (a fact that cannot be read
says so: ``"not a checkout"``, or the package is left out of ``versions``); nothing reads
the network; the command line is stored with the run key redacted
(``modal_rl.run_key.redact``).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

# The distributions a report names, in the order shown; absent ones are left out.
PACKAGES = ("modal-rl", "verl", "slime", "torch", "vllm", "sglang", "ray", "modal")
NOT_A_CHECKOUT = "not a checkout"


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """``{distribution: version}`` of those installed here."""
    from importlib import metadata

    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def git_commit(where: Path | None = None) -> str:
    """The commit of the checkout holding ``where`` (default: this package's source), with
    ``+dirty`` when tracked files changed; :data:`NOT_A_CHECKOUT` when it is not in one (an
    installed wheel) or git is missing."""
    where = Path(where) if where is not None else Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0 or not sha.stdout.strip():
            return NOT_A_CHECKOUT
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return NOT_A_CHECKOUT
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command as a shell would take it back (``shlex.join``), run key redacted."""
    from modal_rl.run_key import redact

    argv = sys.argv if argv is None else argv
    return redact(shlex.join([Path(sys.executable).name if a == sys.executable else a for a in argv]))


def started(argv: list[str] | None = None) -> dict:
    """The run's start facts: ``command``, ``git``, ``versions``, ``started`` (epoch s)."""
    return {
        "command": command_line(argv),
        "git": git_commit(),
        "versions": versions(),
        "started": time.time(),
    }


def ended(exit_code: int, wall_s: float, status: str | None = None) -> dict:
    """The run's end facts: ``exit_code``, ``status`` (``finished`` for 0, else ``failed``
    unless named), ``wall_s``, ``ended`` (epoch s)."""
    return {
        "exit_code": int(exit_code),
        "status": status or ("finished" if exit_code == 0 else "failed"),
        "wall_s": float(wall_s),
        "ended": time.time(),
    }
