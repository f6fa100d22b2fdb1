"""``Sandbox``: what a consumer holds during a lease - a thin, use-once view of a handle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.provider import SandboxHandle
from modal_rl.sandboxes.spec import ExecResult


class LeaseOwner(Protocol):
    """What a lease needs of its pool (``SandboxPool``), named here so lease needs no pool import."""

    async def acquire(self, *, reuse: bool) -> Sandbox: ...

    async def _release(self, handle: SandboxHandle, *, reuse: bool) -> None: ...


class Sandbox:
    """A leased sandbox. After ``release()`` every call raises ``SandboxError``: a released
    sandbox may already belong to someone else (``reuse=True``) or be gone."""

    def __init__(self, pool: LeaseOwner, handle: SandboxHandle, reuse: bool):
        self._pool, self._handle, self.reuse = pool, handle, reuse
        self.id, self.tags = handle.id, dict(handle.tags)
        self.released = False

    def _live(self) -> SandboxHandle:
        if self.released:
            raise SandboxError(f"sandbox {self.id}: lease already released")
        return self._handle

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float = 60.0,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdout_limit_bytes: int | None = None,
        stderr_tail_bytes: int | None = None,
    ) -> ExecResult:
        return await self._live().exec(
            argv,
            timeout_s=timeout_s,
            stdin=stdin,
            env=env,
            cwd=cwd,
            stdout_limit_bytes=stdout_limit_bytes,
            stderr_tail_bytes=stderr_tail_bytes,
        )

    async def write_file(self, path: str, data: bytes | str) -> None:
        await self._live().write_file(path, data)

    async def read_file(self, path: str) -> bytes:
        return await self._live().read_file(path)

    def remaining_s(self) -> float:
        return self._live().remaining_s()

    async def release(self, *, failed: bool = False) -> None:
        """End the lease (idempotent). ``failed=True`` forces termination even with reuse."""
        if not self.released:
            self.released = True
            await self._pool._release(self._handle, reuse=self.reuse and not failed)


class SandboxLease:
    """``async with pool.lease() as sb``: claims on enter, releases on exit (terminating the
    sandbox unless ``reuse=True`` and the block ended without an exception)."""

    def __init__(self, pool: LeaseOwner, reuse: bool):
        self._pool, self._reuse = pool, reuse
        self._sb: Sandbox | None = None

    async def __aenter__(self) -> Sandbox:
        self._sb = await self._pool.acquire(reuse=self._reuse)
        return self._sb

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._sb is not None:
            await self._sb.release(failed=exc_type is not None)
