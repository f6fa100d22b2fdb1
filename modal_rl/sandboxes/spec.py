"""``SandboxSpec`` (what to run) and ``ExecResult`` (what a command returned)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SandboxSpec:
    """The environment one sandbox provides. Validated on construction.

    ``image``: for ``LocalProvider`` ``None``/``"host"`` (the host's /usr, /etc basics and the
    running Python, read-only) or a directory holding a root filesystem; for ``ModalProvider``
    a registry tag (``"python:3.11-slim"``) or a ``modal.Image``.
    ``cpu`` (cores), ``memory_mb`` (per process locally, per sandbox on Modal), ``timeout_s``
    (the sandbox's whole lifetime), ``network`` (False: no network at all), ``max_procs``
    (processes alive at once), ``disk_mb`` (size of the writable work dir), ``workdir``.
    """

    image: Any = None
    cpu: float = 1.0
    memory_mb: int = 1024
    timeout_s: float = 600.0
    network: bool = False
    max_procs: int = 64
    disk_mb: int = 512
    workdir: str = "/workspace"
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.cpu, int | float) and math.isfinite(self.cpu) and self.cpu > 0):
            raise ValueError(f"SandboxSpec.cpu must be a positive number of cores, got {self.cpu!r}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise ValueError(f"SandboxSpec.memory_mb must be an int >= 64, got {self.memory_mb!r}")
        if not (
            isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise ValueError(
                f"SandboxSpec.timeout_s must be a positive number of seconds, got {self.timeout_s!r}"
            )
        if not isinstance(self.network, bool):
            raise ValueError(f"SandboxSpec.network must be a bool, got {self.network!r}")
        if not (isinstance(self.max_procs, int) and self.max_procs >= 2):
            raise ValueError(f"SandboxSpec.max_procs must be an int >= 2, got {self.max_procs!r}")
        if not (isinstance(self.disk_mb, int) and self.disk_mb >= 1):
            raise ValueError(f"SandboxSpec.disk_mb must be an int >= 1, got {self.disk_mb!r}")
        if not (isinstance(self.workdir, str) and self.workdir.startswith("/") and self.workdir != "/"):
            raise ValueError(
                f"SandboxSpec.workdir must be an absolute path other than '/', got {self.workdir!r}"
            )
        bad = [k for k, v in self.env.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise ValueError(f"SandboxSpec.env must map str to str; bad keys: {bad!r}")


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command. A non-zero ``returncode`` or ``timed_out`` is the command's result,
    not an infrastructure failure. Negative ``returncode`` = killed by that signal.
    ``stdout_truncated``: the command wrote more stdout than the exec kept (its
    ``stdout_limit_bytes``, or the provider's own cap)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    stdout_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out
