"""A slime ``Sandbox`` (``slime/agent/sandbox.py`` protocol) backed by a modal_rl SandboxPool.

    async with PoolSandbox(args) as sb:             # leases a warm sandbox from the process's pool
        rc, out, err = await sb.exec("python3 -V", timeout=30)
        await sb.write_file("/workspace/a.txt", "hi")
        text = await sb.read_file("/workspace/a.txt")

Protocol details: ``cmd`` is a shell string (run with ``sh -c``); ``user`` other than root is
switched with ``runuser`` (works where the sandbox has root, i.e. Modal; the local bubblewrap
sandbox has no capabilities and reports the failure in ``err``); a timed-out command returns
exit code 124; ``check=True`` raises ``RuntimeError`` on a non-zero exit; ``read_file`` of a
missing file returns "" (as slime's E2B backend does). ``idempotent`` is accepted and ignored:
the pool never replays a command. Infrastructure failures raise ``SandboxError``.

Pool settings: ``args.modal_rl_sandbox`` (slime ``--custom-config-path``), then keyword
arguments, then the ``MODAL_RL_SANDBOX_*`` environment (``slime_modal.config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.lease import Sandbox as Lease
from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.shared import on_pool_loop
from slime_modal.config import rollout_pool


class PoolSandbox:
    """Satisfies ``slime.agent.sandbox.Sandbox``; one single-use lease per ``async with``.

    Without ``pool``, the lease comes from the process's pool and every call runs on that
    pool's loop (``slime_modal.config``); a given ``pool`` is used on the caller's loop."""

    def __init__(self, args: Any = None, *, pool: SandboxPool | None = None, **pool_settings: Any):
        self._args, self._pool, self._settings = args, pool, pool_settings
        self._lease: Lease | None = None
        self.sandbox_id = ""

    async def _run(self, coro):
        return await (coro if self._pool is not None else on_pool_loop(coro))

    async def _acquire(self) -> Lease:
        pool = self._pool or await rollout_pool(self._args, **self._settings)
        return await pool.acquire()

    async def __aenter__(self) -> PoolSandbox:
        self._lease = await self._run(self._acquire())
        self.sandbox_id = self._lease.id
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            await self._run(lease.release(failed=exc_type is not None))

    def _sb(self) -> Lease:
        if self._lease is None:
            raise SandboxError("PoolSandbox used outside 'async with'")
        return self._lease

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
        idempotent: bool = True,
    ) -> tuple[int, str, str]:
        if not isinstance(cmd, str) or not cmd:
            raise ValueError(f"exec needs a non-empty shell command string, got {cmd!r}")
        argv = ["sh", "-c", cmd] if user == "root" else ["runuser", "-u", user, "--", "sh", "-c", cmd]
        r = await self._run(self._sb().exec(argv, timeout_s=timeout, env=env))
        rc = 124 if r.timed_out else r.returncode
        if check and rc != 0:
            raise RuntimeError(f"sandbox exec failed (exit={rc}): {cmd[:120]}\n{r.stderr[-400:]}")
        return rc, r.stdout, r.stderr

    async def write_file(self, sandbox_path: str, content: str | bytes | Path, *, user: str = "root") -> None:
        data = content.read_bytes() if isinstance(content, Path) else content
        await self._run(self._sb().write_file(sandbox_path, data))

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        try:
            return (await self._run(self._sb().read_file(sandbox_path))).decode(errors="replace")
        except FileNotFoundError:
            return ""
