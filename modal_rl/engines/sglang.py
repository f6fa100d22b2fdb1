"""SGLang behind the Engine port: its launch command, health request, and disk weight reload.

The server is ``sglang.launch_server`` started through ``modal_rl.engines.keyed_launch``, which
adds ``--api-key``/``--admin-api-key`` inside the process from ``MODAL_RL_ENGINE_BEARER`` (SGLang
takes its keys only as flags, and a flag on a command line is visible to every local user).
SGLang then refuses every route without the bearer except its ``/health*``, ``/ready*`` and
``/metrics*``; ``--guard=sglang`` puts modal_rl's guard in front of its app too, which opens only
the routes the run uses (``sglang_routes``: with the bearer, generation, status and the run's own
weight path; without it, ``GET /health`` alone). Healthy = a keyed 1-token ``/generate``.

Weights: the framework (slime) pushes its versions itself; a new server is brought to the newest
one the way slime reloads its engines (``catch_up``): ``POST /pull_weights`` into the local
checkpoint dir when there is one, then ``POST /update_weights_from_disk`` of that dir (or of the
version's own directory). Stage/commit, pause/resume, cache and adapter calls are not driven
through this port for SGLang: they raise ``NotImplementedError`` naming the engine.

The engine's guard lets those two routes name only paths under the model, ``source_dir`` and
``local_checkpoint_dir`` (``env``, ``sglang_paths``): a ``newest()`` directory outside
``source_dir`` is refused there.

Invariants: ``sglang_argv`` never carries a key; ``catch_up`` of version 0 (nothing published
yet: the server's own ``--model-path``) sends nothing; an answer ``{"success": false}`` is a
``RuntimeError`` naming the route and the server's message (its tail, 300 characters).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from modal_rl.engines.base import Engine
from modal_rl.engines.health import sglang_generate
from modal_rl.engines.sglang_paths import WeightDirs

SGLANG_MODULE = "sglang.launch_server"
# SGLang takes its keys only as flags (no env var): inserted in-process by keyed_launch.
KEY_FLAGS = ("--api-key", "--admin-api-key")
SERVER = (
    "python3",
    "-m",
    "modal_rl.engines.keyed_launch",
    *(f"--key-flag={flag}" for flag in KEY_FLAGS),
    "--guard=sglang",  # our route allow-list in front of SGLang's app (engines.sglang_routes)
    SGLANG_MODULE,
)
SGLANG_PORT = 30000


@dataclass(frozen=True)
class DiskReload:
    """How a new server catches up (slime's disk weight path): ``newest()`` gives the newest
    complete version and the directory holding it (version 0: none published yet);
    ``source_dir`` is where versions are published, ``local_checkpoint_dir`` where each
    server copies one before loading it (None: load the version's directory itself)."""

    newest: Callable[[], tuple[int, str | None]]
    source_dir: str | None = None
    local_checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        if not callable(self.newest):
            raise ValueError(f"DiskReload newest={self.newest!r}: give a function () -> (version, directory)")
        if self.local_checkpoint_dir and not self.source_dir:
            raise ValueError("DiskReload: a local_checkpoint_dir needs the source_dir it pulls versions from")


def sglang_argv(
    server: Iterable[str], model: str, *, tp: int = 1, pp: int = 1, flags: Iterable[str] = ()
) -> list[str]:
    """``sglang.launch_server`` of ``model`` with ``tp`` x ``pp`` GPUs, ``{host}``/``{port}`` left
    open, no warmup (the pool's health check is the warmup), metrics on, then ``flags``."""
    cmd = [*server, "--model-path", str(model), "--host", "{host}", "--port", "{port}", "--trust-remote-code"]
    cmd += ["--tp-size", str(tp), "--pp-size", str(pp), "--skip-server-warmup", "--enable-metrics"]
    return cmd + [str(flag) for flag in flags]


class SglangEngine(Engine):
    """An SGLang server; see the module docstring."""

    name = "sglang"
    port = SGLANG_PORT
    # for users that hold only the class (the adapters get it from the registry)
    SERVER = SERVER
    KEY_FLAGS = KEY_FLAGS
    DiskReload = DiskReload

    def __init__(
        self,
        model: str = "",
        *,
        key: str | None = None,
        server: Iterable[str] = SERVER,
        tp: int = 1,
        pp: int = 1,
        flags: Iterable[str] = (),
        reload: DiskReload | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(key=key)
        self.model, self.server, self.tp, self.pp = model, tuple(server), tp, pp
        self.flags = [str(flag) for flag in flags]
        self.reload, self.timeout_s = reload, timeout_s

    def argv(self) -> list[str]:
        return sglang_argv(self.server, self.model, tp=self.tp, pp=self.pp, flags=self.flags)

    def generate_request(self) -> dict[str, Any]:
        return sglang_generate()

    def env(self) -> dict[str, str]:
        """The directories the engine's guard lets the weight routes name (``sglang_paths``):
        the model, and ``reload``'s source and local checkpoint directories."""
        source, local = (
            (self.reload.source_dir, self.reload.local_checkpoint_dir) if self.reload else (None, None)
        )
        return WeightDirs.of(self.model, load=[source], pull=[local]).env()

    def catch_up(self, url: str) -> dict[str, Any]:
        """Bring the server at ``url`` to the newest version ``reload.newest()`` names;
        ``{"weight_version", "load_s"}`` (``{}`` when this driver has no ``reload``)."""
        if self.reload is None:
            return {}
        t0 = time.monotonic()
        version, version_dir = self.reload.newest()
        if version > 0:
            self.reload_from_disk(url, version, version_dir)
        return {"weight_version": version, "load_s": round(time.monotonic() - t0, 3)}

    def reload_from_disk(self, url: str, version: int, version_dir: str | None) -> None:
        """Load ``version`` from disk as slime's own reload does (module docstring)."""
        model_path, reload = version_dir, self.reload
        if reload is not None and reload.local_checkpoint_dir:
            pull = {
                "local_checkpoint_dir": reload.local_checkpoint_dir,
                "source_dir": reload.source_dir,
                "target_version": version,
            }
            self._admin_post(url, "/pull_weights", pull)
            model_path = reload.local_checkpoint_dir
        self._admin_post(
            url, "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)}
        )

    def _admin_post(self, url: str, path: str, body: dict) -> dict:
        from modal_rl.engines.auth import KEYED_OPENER, bearer_header, check_key_safe_url

        headers = {"Content-Type": "application/json"}
        if self.key:
            check_key_safe_url(url)
            headers.update(bearer_header(self.key))  # the engine's bearer, derived from the run key
        req = urllib.request.Request(
            url.rstrip("/") + path, json.dumps(body).encode(), headers, method="POST"
        )
        with KEYED_OPENER.open(req, timeout=self.timeout_s) as resp:  # no proxy, no redirect
            answer = json.loads(resp.read() or b"{}")
        if answer.get("success") is False:
            raise RuntimeError(f"{path} failed: {str(answer.get('message'))[-300:]}")
        return answer
