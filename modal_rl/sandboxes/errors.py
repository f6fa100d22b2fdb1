"""Typed errors of the sandbox pool.

Invariant for consumers: every failure of the *infrastructure* (a sandbox that could not be
created, did not become ready, died mid-use, or a pool that gave up) is a ``SandboxError``.
A rollout that catches ``SandboxError`` must mask its sample; it must never turn it into a
reward. A command that merely fails inside a healthy sandbox is not an error: it is an
``ExecResult`` with a non-zero ``returncode`` or ``timed_out=True``.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class: the sandbox infrastructure failed; the sample must be masked, not scored."""


class ProviderUnavailableError(SandboxError):
    """The provider cannot work on this host at all (e.g. bubblewrap is not installed)."""


class TransientProviderError(SandboxError):
    """A create failed in a way worth retrying (provider hiccup, lost connection)."""


class RateLimitedError(TransientProviderError):
    """The provider refused a create because of its rate limit; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SandboxStartError(SandboxError):
    """A sandbox meant for this consumer could not be started.

    ``kind`` is one of ``"create"``, ``"ready"``, ``"create_timeout"``, ``"ready_timeout"``,
    ``"claim_timeout"``, ``"pool_failed"``; ``cause`` is the last underlying exception.
    """

    def __init__(self, message: str, *, kind: str, cause: BaseException | None = None):
        super().__init__(message)
        self.kind = kind
        self.cause = cause


class SandboxStartTimeout(SandboxStartError):
    """Creating, readying or claiming a sandbox ran past its phase timeout."""


class PoolFailedError(SandboxStartError):
    """The pool saw too many consecutive failed starts and stopped refilling.

    Raised to every waiting and every later claim until the pool is closed, with the last
    cause attached, so a broken image or exhausted quota surfaces as one clear error.
    """


class SandboxLostError(SandboxError):
    """The sandbox died or became unreachable while a consumer was using it."""


class PoolClosedError(SandboxError):
    """A claim was made on a pool that is closed or closing."""
