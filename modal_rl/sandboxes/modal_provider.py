"""``ModalProvider``: sandboxes as Modal Sandboxes (``modal.Sandbox.create.aio``, Modal 1.6).

``modal`` is imported lazily, inside methods, so the rest of the package never pays for it.
The request a sandbox is created with is built by the pure ``create_kwargs`` (tested offline
against the real ``modal.Sandbox.create`` signature); everything else is a thin mapping of
the handle port onto Modal's async API.

Readiness: a ``Probe.with_exec("mkdir", "-p", workdir)`` probe, awaited with
``wait_until_ready``, so "ready" means the container runs commands and the work dir exists.
Error mapping: ``ResourceExhaustedError`` (Modal's answer to too many creates) becomes
``RateLimitedError``; connection/internal/service errors become ``TransientProviderError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from modal_rl.sandboxes.envguard import check_env
from modal_rl.sandboxes.errors import RateLimitedError, SandboxLostError, TransientProviderError
from modal_rl.sandboxes.provider import Provider, SandboxHandle, check_argv, check_output_bounds
from modal_rl.sandboxes.spec import ExecResult, SandboxSpec

_TRANSIENT = ("ConnectionError", "InternalError", "InternalFailure", "ServiceError", "TimeoutError")


def map_modal_error(exc: BaseException) -> BaseException:
    """Translate a Modal exception into the pool's retry taxonomy (others pass through)."""
    import modal.exception as me

    if isinstance(exc, me.ResourceExhaustedError):
        return RateLimitedError(f"modal: {exc}", retry_after_s=None)
    if any(isinstance(exc, getattr(me, name)) for name in _TRANSIENT):
        return TransientProviderError(f"modal: {type(exc).__name__}: {exc}")
    return exc


class ModalProvider(Provider):
    """Modal Sandboxes in app ``app_name`` (created if missing). Default create limit: Modal's
    published 5 creates/s, shared host-wide through the pool's file token bucket."""

    name = "modal"

    def __init__(
        self,
        app_name: str = "modal-rl-sandboxes",
        *,
        create_rate: float = 5.0,
        create_burst: int = 5,
        region: str | None = None,
        environment_name: str | None = None,
        extra_create_kwargs: Mapping[str, Any] | None = None,
    ):
        if not app_name:
            raise ValueError("ModalProvider needs an app_name")
        self.app_name, self.region, self.environment_name = app_name, region, environment_name
        self.create_rate, self.create_burst = create_rate, create_burst
        self.extra_create_kwargs = dict(extra_create_kwargs or {})
        if "secrets" in self.extra_create_kwargs:
            # A Modal Secret would put credentials in the env of untrusted code.
            raise ValueError(
                "ModalProvider: sandboxes take no secrets; drop 'secrets' from extra_create_kwargs"
            )
        self._app = None

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ModalProvider:
        return cls(app_name=settings["app"])

    def image_for(self, spec: SandboxSpec):
        import modal

        if spec.image is None:  # pytest for the test runner's pytest-form reward tests
            return modal.Image.debian_slim().pip_install("pytest>=8")
        if isinstance(spec.image, str):
            return modal.Image.from_registry(spec.image)
        if isinstance(spec.image, modal.Image):
            return spec.image
        raise ValueError(
            f"ModalProvider: image must be None, a registry tag or a modal.Image, got {spec.image!r}"
        )

    def create_kwargs(self, spec: SandboxSpec, tags: Mapping[str, str], app: Any) -> dict[str, Any]:
        """The keyword arguments of ``modal.Sandbox.create`` for ``spec`` (pure, no network)."""
        from modal.sandbox import Probe

        kwargs: dict[str, Any] = {
            "app": app,
            "image": self.image_for(spec),
            "cpu": float(spec.cpu),
            "memory": int(spec.memory_mb),
            "timeout": max(1, math.ceil(spec.timeout_s)),
            "block_network": not spec.network,
            "tags": dict(tags),
            "env": check_env(spec.env, "SandboxSpec.env") or None,
            "readiness_probe": Probe.with_exec("mkdir", "-p", spec.workdir, interval_ms=100),
        }
        if self.region:
            kwargs["region"] = self.region
        if self.environment_name:
            kwargs["environment_name"] = self.environment_name
        kwargs.update(self.extra_create_kwargs)
        return kwargs

    async def _get_app(self):
        import modal

        if self._app is None:
            self._app = await modal.App.lookup.aio(self.app_name, create_if_missing=True)
        return self._app

    async def create(self, spec: SandboxSpec, *, tags: Mapping[str, str]) -> ModalSandbox:
        import modal

        try:
            kwargs = self.create_kwargs(spec, tags, await self._get_app())
            sb = await modal.Sandbox.create.aio(**kwargs)
        except Exception as exc:
            mapped = map_modal_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        return ModalSandbox(sb, spec, dict(tags))

    async def sweep(self, tags: Mapping[str, str]) -> int:
        import modal

        if not tags:
            raise ValueError("sweep needs at least one tag (key=value); refusing to kill every sandbox")
        count = 0
        async for sb in modal.Sandbox.list.aio(tags=dict(tags)):
            await sb.terminate.aio()
            count += 1
        return count


async def _read_head(stream: Any, limit: int | None) -> tuple[bytes, bool]:
    """The first ``limit`` bytes of a Modal exec stream (all of it when ``None``) and whether
    there was more. Over the limit the stream is closed: the rest is never fetched (a command
    still writing then blocks until its exec timeout, which is what it chose)."""
    if limit is None:
        return await stream.read.aio(), False
    buf = bytearray()
    async for chunk in stream:
        buf += chunk
        if len(buf) > limit:
            with contextlib.suppress(Exception):
                await stream.aclose.aio()
            return bytes(buf[:limit]), True
    return bytes(buf), False


async def _read_tail(stream: Any, keep: int | None) -> bytes:
    """The last ``keep`` bytes of a Modal exec stream (all of it when ``None``), holding no more
    than 2x ``keep`` + one chunk at a time."""
    if keep is None:
        return await stream.read.aio()
    buf = bytearray()
    async for chunk in stream:
        buf += chunk
        if len(buf) > 2 * keep:
            del buf[: len(buf) - keep]
    return bytes(buf[max(0, len(buf) - keep) :])


class ModalSandbox(SandboxHandle):
    """Host side of one Modal Sandbox."""

    def __init__(self, sb: Any, spec: SandboxSpec, tags: dict[str, str]):
        self._sb, self.spec, self.tags = sb, spec, tags
        self.id = sb.object_id
        self.expires_at = time.monotonic() + spec.timeout_s
        self._terminated = False

    def is_alive(self) -> bool:
        return not self._terminated and getattr(self._sb, "returncode", None) is None

    async def ready(self) -> None:
        await self._sb.wait_until_ready.aio(timeout=max(1, math.ceil(self.remaining_s())))

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
        check_argv(argv)
        check_output_bounds(stdout_limit_bytes, stderr_tail_bytes)
        t0 = time.monotonic()
        truncated = False
        try:
            proc = await self._sb.exec.aio(
                *argv,
                timeout=max(1, math.ceil(timeout_s)),
                workdir=cwd or self.spec.workdir,
                env=check_env(env, "exec env") or None,
                text=False,
            )
            if stdin is not None:
                proc.stdin.write(stdin.encode() if isinstance(stdin, str) else stdin)
                proc.stdin.write_eof()
                await proc.stdin.drain.aio()
            (out, truncated), err = await asyncio.gather(
                _read_head(proc.stdout, stdout_limit_bytes), _read_tail(proc.stderr, stderr_tail_bytes)
            )
            rc = await asyncio.wait_for(proc.wait.aio(), timeout_s + 30)
        except Exception as exc:
            import modal.exception as me

            if isinstance(exc, me.ExecTimeoutError):
                return ExecResult(-9, "", "", True, time.monotonic() - t0)
            if isinstance(exc, me.SandboxTerminatedError | me.SandboxTimeoutError | TimeoutError):
                raise SandboxLostError(f"modal sandbox {self.id}: {type(exc).__name__}: {exc}") from exc
            raise
        # Modal 1.6 reports a command killed at its exec deadline as returncode -1; report it
        # like the local provider does (SIGKILL, timed_out=True).
        timed_out = rc == -1
        return ExecResult(
            -9 if timed_out else rc,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            timed_out,
            time.monotonic() - t0,
            truncated,
        )

    async def write_file(self, path: str, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self._sb.filesystem.write_bytes.aio(raw, self._abs(path))

    async def read_file(self, path: str) -> bytes:
        import modal.exception as me

        try:
            return await self._sb.filesystem.read_bytes.aio(self._abs(path))
        except me.SandboxFilesystemNotFoundError as exc:
            raise FileNotFoundError(2, f"modal sandbox {self.id}: {exc}") from exc

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.spec.workdir}/{path}"

    async def terminate(self) -> None:
        if not self._terminated:
            self._terminated = True
            # Already gone is fine; the tag sweep is the backstop for anything else.
            with contextlib.suppress(Exception):
                await self._sb.terminate.aio()

    def kill_now(self) -> None:
        if self._terminated:
            return
        self._terminated = True
        # Blocking Modal calls may not run on an event-loop thread: use a short-lived thread.
        t = threading.Thread(target=lambda: self._sb.terminate(), daemon=True)
        t.start()
        t.join(timeout=5)
