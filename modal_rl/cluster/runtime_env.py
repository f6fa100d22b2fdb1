"""A user's Ray runtime env, as it meets a container: settings that only make sense on the
machine where the line was written are rewritten to their in-container equivalent, or refused
in one line with the fix.

- ``py_executable`` running ``uv run ...`` (a uv workspace on this machine, ``uv.lock`` and all)
  or a local virtualenv's interpreter: in the container the image's own Python already holds
  the framework with the extras the line needs, which is what ``uv run --extra X`` selected
  here, so the setting is dropped (Ray's default interpreter). The ``--extra`` names are
  returned, so the image can include them.
- ``working_dir`` / ``py_modules`` naming a directory on this machine: Ray would upload it
  from the job's driver, which runs in the container, where the directory does not exist.
  Refused, unless the path is under a mounted Volume or is a remote URI.

Invariant: reads only the values given and the file system's view of nothing (no network).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

REMOTE_SCHEMES = ("s3://", "gs://", "https://", "http://", "file://")
# Interpreters a container image has on PATH: kept as given.
PLAIN_INTERPRETERS = ("python", "python3")


class RuntimeEnvError(ValueError):
    """A runtime-env setting that cannot work in a container; the message is one line."""


@dataclass
class Rewrite:
    """The outcome for one setting: ``value`` to use (``None``: drop), and the notice to print."""

    value: str | None
    note: str | None = None
    extras: list[str] = field(default_factory=list)


def uv_extras(command: list[str]) -> list[str]:
    """``--extra X`` / ``--extra=X`` names of a ``uv run`` command, in order."""
    found: list[str] = []
    for i, token in enumerate(command):
        if token == "--extra" and i + 1 < len(command):
            found.append(command[i + 1])
        elif token.startswith("--extra="):
            found.append(token.split("=", 1)[1])
    return found


def _under(path: str, mounts) -> bool:
    norm = os.path.normpath(path)
    return any(norm == m.rstrip("/") or norm.startswith(m.rstrip("/") + "/") for m in mounts)


def py_executable(key: str, value: str) -> Rewrite:
    text = (value or "").strip().strip("'\"")
    if text.lower() in ("", "null", "none"):
        return Rewrite(value)
    try:
        command = shlex.split(text)
    except ValueError:
        raise RuntimeEnvError(
            f"{key}={value}: not a command line (unbalanced quotes); fix or drop it"
        ) from None
    head = os.path.basename(command[0]) if command else ""
    if head == "uv":
        extras = uv_extras(command)
        return Rewrite(
            None,
            f"{key}={text!r} runs a uv workspace on this machine; in the containers the image's Python "
            f"holds the framework{' with extras ' + ', '.join(extras) if extras else ''}, so it is dropped",
            extras,
        )
    if command[0] in PLAIN_INTERPRETERS and len(command) == 1:
        return Rewrite(value)
    if os.path.isabs(command[0]) and (
        ".venv" in command[0] or "/envs/" in command[0] or "/bin/" in command[0]
    ):
        return Rewrite(
            None,
            f"{key}={text} is an interpreter on this machine; the containers use the image's Python "
            "(which holds the framework), so it is dropped",
        )
    raise RuntimeEnvError(
        f"{key}={text}: the containers have no such command; drop it (the image's Python holds the "
        "framework) or set it to python3"
    )


def local_dir(key: str, value: str, mounts) -> Rewrite:
    """``working_dir`` / ``py_modules`` entries: remote URIs and Volume paths pass."""
    text = (value or "").strip().strip("'\"")
    if text.lower() in ("", "null", "none") or text.startswith(REMOTE_SCHEMES) or _under(text, mounts):
        return Rewrite(value)
    where = os.path.abspath(os.path.expanduser(text))
    raise RuntimeEnvError(
        f"{key}={text}: Ray would upload {where} from the job's driver, which runs in a container "
        "where it does not exist; drop it (the image holds the framework and modal-rl), or put the "
        "code on a Volume (--volume NAME:/code) and set it to a path under /code"
    )


def rewrite(settings: dict[str, str], mounts=()) -> dict[str, Rewrite]:
    """``{key: Rewrite}`` for a runtime env given as ``{dotted key: value}``; the key's last
    component says what it is (``...runtime_env.py_executable``, ``...working_dir``)."""
    out: dict[str, Rewrite] = {}
    for key, value in settings.items():
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "py_executable":
            out[key] = py_executable(key, value)
        elif leaf == "working_dir":
            out[key] = local_dir(key, value, mounts)
        elif leaf == "py_modules":
            from modal_rl.cluster.local_inputs import hydra_values

            for item in hydra_values(value):
                local_dir(key, str(item), mounts)
            out[key] = Rewrite(value)
    return out
