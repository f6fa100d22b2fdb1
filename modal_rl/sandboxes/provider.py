"""The provider port: how the pool creates, probes, uses and destroys one sandbox.

One file per implementation: ``local.py`` (bubblewrap) and ``modal_provider.py`` (Modal), found by
name in ``providers.PROVIDERS``. The pool only talks to these two ABCs, so a test double for fault injection is a subclass too.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping, Sequence

from modal_rl.sandboxes.spec import ExecResult, SandboxSpec

TAG_POOL = "modal-rl-pool"
TAG_RUN = "modal-rl-run"


def check_argv(argv: Sequence[str]) -> None:
    """Every provider's exec takes the same argv: a non-empty list of str, never a shell string."""
    if isinstance(argv, str | bytes) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"exec needs a non-empty list of str, e.g. ['sh', '-c', cmd]; got {argv!r}")


def check_output_bounds(stdout_limit_bytes: int | None, stderr_tail_bytes: int | None) -> None:
    """Both bounds are ``None`` or a non-negative int (bytes)."""
    for name, value in (("stdout_limit_bytes", stdout_limit_bytes), ("stderr_tail_bytes", stderr_tail_bytes)):
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"exec {name} must be None or a number of bytes >= 0, got {value!r}")


class SandboxHandle(abc.ABC):
    """One live sandbox. ``terminate`` is idempotent and never raises for an already-dead sandbox.

    ``expires_at`` is a ``time.monotonic()`` deadline after which the provider kills it.
    """

    id: str
    tags: dict[str, str]
    expires_at: float

    def remaining_s(self) -> float:
        return self.expires_at - time.monotonic()

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Cheap local check (no round trip): False once the sandbox is known dead."""

    @abc.abstractmethod
    async def ready(self) -> None:
        """Readiness probe: returns once the sandbox can run commands; raises otherwise."""

    @abc.abstractmethod
    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdout_limit_bytes: int | None = None,
        stderr_tail_bytes: int | None = None,
    ) -> ExecResult:
        """Run ``argv`` to completion or until ``timeout_s``; raises ``SandboxLostError`` only if
        the sandbox itself fails.

        Output bounds, applied where the bytes are read (so the caller never receives more):
        ``stdout_limit_bytes`` keeps the first that many bytes of stdout (``stdout_truncated``
        says the command wrote more); ``stderr_tail_bytes`` keeps the last that many bytes of
        stderr. ``None``: the provider's default (local: the first ``output_cap_bytes`` of each
        stream; Modal: all of it)."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes | str) -> None: ...

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes: ...

    @abc.abstractmethod
    async def terminate(self) -> None: ...

    @abc.abstractmethod
    def kill_now(self) -> None:
        """Synchronous best-effort kill, safe to call from a signal handler or atexit."""


class Provider(abc.ABC):
    """Creates sandboxes and sweeps orphans by tag.

    ``create_rate`` / ``create_burst`` are the provider's published create-rate limit, used by
    the pool's token bucket unless the caller passes its own.
    """

    name: str = "provider"
    create_rate: float = 5.0
    create_burst: int = 5

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> Provider:
        """The provider a shared pool's settings (``shared.settings``) ask for, by backend name
        (``providers.PROVIDERS``). Default: built with no arguments."""
        return cls()

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec, *, tags: Mapping[str, str]) -> SandboxHandle:
        """Start one sandbox (not necessarily ready yet). Raise ``TransientProviderError`` /
        ``RateLimitedError`` for retryable failures, any other exception for permanent ones."""

    def kill_starting_now(self) -> None:  # noqa: B027  (optional hook: nothing to do by default)
        """Synchronous last resort: end sandboxes whose ``create`` has not returned yet."""

    @abc.abstractmethod
    async def sweep(self, tags: Mapping[str, str]) -> int:
        """Terminate every sandbox carrying all of ``tags``; returns how many were terminated."""
