"""Disaggregated inference engines: N servers (vLLM, SGLang, ...) on their own machines.

``EnginePool`` is the port: ``start()`` brings up ``spec.count`` servers, each running
``spec.command`` and answering ``GET spec.health_path``, and returns their reachable base URLs
(``http://127.0.0.1:port`` locally, ``https://...`` through a Modal TLS tunnel) in engine
order; ``stop()`` ends every one of them.
``running(spec, backend)`` is the context manager the adapters use.

Implementations: ``LocalEnginePool`` (processes on 127.0.0.1, here) and ``ModalEnginePool``
(``engines_modal.py``: one Modal GPU container per engine, a TLS tunnel each).

Auth (``spec.auth``): ``"bearer"`` (the default) says the server refuses requests without
``Authorization: Bearer <run key>`` and reads the key from ``MODAL_RL_RUN_KEY`` in its own
environment (vLLM through ``engine_auth.RunKeyAuth``; SGLang through ``keyed_launch``). The
pool then needs the run's key to start (``run_key()``), hands it to each engine through the
environment only (local: the process env; Modal: a Modal Secret made for the run), and sends it
with every health check. ``None`` is an explicitly keyless server: it gets no key at all.

Invariants:
- ``start()`` returns only when every engine answered its health endpoint, or raises
  ``EngineStartError`` naming the engine, why, and its last log lines; in that case every
  engine it started has already been stopped (one bad engine never leaves the others running);
- ``stop()`` is idempotent and is also run by ``running()`` on errors and KeyboardInterrupt;
- ``spec.command`` is a template: ``{port}`` and ``{host}`` are filled per engine (the port
  an engine listens on, the interface it binds), nothing else is interpreted;
- the run key is never in ``spec`` (``env`` may not name it), ``to_dict()``, ``describe()``,
  a command line or an error message (engine log tails are redacted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modal_rl.cluster import procs
from modal_rl.cluster.engine_auth import bearer_header, key_safe_url
from modal_rl.cluster.spec import _ENV_RE, _NAME_RE, ClusterSpecError, GpuSpec
from modal_rl.run_key import RAY_TOKEN_ENV, RUN_KEY_ENV, MissingRunKeyError, redact, run_key

MAX_MODAL_TIMEOUT_S = 24 * 3600
LOG_TAIL_LINES = 30
AUTH_MODES = ("bearer", None)
KEY_ENVS = (RUN_KEY_ENV, RAY_TOKEN_ENV)


class EngineStartError(RuntimeError):
    """An engine did not come up; the message names it, says why, and ends with its last lines."""


@dataclass(frozen=True)
class EngineSpec:
    """``count`` identical inference servers.

    ``gpu`` is ``"TYPE:COUNT"`` per engine (Modal; ignored locally); ``image`` a registry image
    (Modal; default: the framework's own image must be given by the adapter); ``volumes`` maps
    Modal Volume names to mount paths; ``pip`` lists packages the image gets on Modal (locally
    the running environment must have them); ``startup_timeout_s`` bounds the wait for health
    after start (model download and load included), ``serve_timeout_s`` the life of an engine.
    ``min_containers``/``max_containers`` are the engine function's Modal scaling bounds;
    ``max_containers`` defaults to ``count`` so an engine function never grows beyond the pool.
    ``auth``: ``"bearer"`` (server needs the run key, given through ``MODAL_RL_RUN_KEY``) or
    ``None`` (keyless: only for servers that must not see the key); see the module docstring.
    """

    command: tuple[str, ...]
    count: int = 1
    gpu: str | None = None
    image: str | None = None
    port: int = 8000
    health_path: str = "/health"
    volumes: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    pip: tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    serve_timeout_s: float = float(MAX_MODAL_TIMEOUT_S)
    min_containers: int | None = None
    max_containers: int | None = None
    name: str = "engine"
    auth: str | None = "bearer"

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(str(a) for a in self.command))
        object.__setattr__(self, "secrets", tuple(self.secrets))
        object.__setattr__(self, "pip", tuple(str(p) for p in self.pip))
        object.__setattr__(self, "volumes", dict(self.volumes))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})
        if self.max_containers is None:
            object.__setattr__(self, "max_containers", self.count)
        self._validate()

    def _validate(self) -> None:
        if not self.command:
            raise ClusterSpecError("engine command is empty")
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ClusterSpecError(f"engine count={self.count!r}: must be an integer >= 1")
        GpuSpec.parse(self.gpu)
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ClusterSpecError(f"engine port={self.port!r}: must be 1..65535")
        if not self.health_path.startswith("/"):
            raise ClusterSpecError(f"health_path={self.health_path!r}: must start with '/'")
        for name in ("startup_timeout_s", "serve_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ClusterSpecError(f"{name}={value!r}: must be a positive number of seconds")
        if self.serve_timeout_s > MAX_MODAL_TIMEOUT_S:
            raise ClusterSpecError(f"serve_timeout_s={self.serve_timeout_s}: Modal allows at most 24 h")
        if self.max_containers < self.count:
            raise ClusterSpecError(
                f"max_containers={self.max_containers} < count={self.count}: every engine needs a container"
            )
        if self.min_containers is not None and not 0 <= self.min_containers <= self.max_containers:
            raise ClusterSpecError(
                f"min_containers={self.min_containers}: must be between 0 and max_containers={self.max_containers}"
            )
        for vol, path in self.volumes.items():
            if not _NAME_RE.match(str(vol)) or not str(path).startswith("/"):
                raise ClusterSpecError(
                    f"volume {vol!r} at {path!r}: Modal-valid name and absolute path needed"
                )
        for secret in self.secrets:
            if not isinstance(secret, str) or not _NAME_RE.match(secret):
                raise ClusterSpecError(f"engine secret name {secret!r}: use letters, digits, '.', '_' or '-'")
        for key in self.env:
            if not _ENV_RE.match(key):
                raise ClusterSpecError(f"engine env key {key!r}: must be a shell identifier")
            if key in KEY_ENVS:
                raise ClusterSpecError(
                    f"engine env key {key!r}: the pool gives engines the run key itself (auth='bearer'); "
                    "drop it from env"
                )
        if self.auth not in AUTH_MODES:
            raise ClusterSpecError(f"engine auth={self.auth!r}: choose 'bearer' or None (keyless)")
        if not _NAME_RE.match(self.name):
            raise ClusterSpecError(f"engine name {self.name!r}: use letters, digits, '.', '_' or '-'")

    def argv(self, host: str, port: int) -> list[str]:
        """The command for one engine: ``{host}``/``{port}`` filled in."""
        return [a.replace("{host}", host).replace("{port}", str(port)) for a in self.command]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["command"] = list(self.command)
        data["secrets"] = list(self.secrets)
        data["pip"] = list(self.pip)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineSpec:
        return cls(**data)


# Engines are reached directly: an http_proxy in the environment must not reroute health checks.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe(url: str, timeout_s: float = 2.0, key: str | None = None) -> tuple[bool, str]:
    """One GET, with ``Authorization: Bearer key`` when a key is given (only over https or to
    loopback: elsewhere nothing is sent); (answered 2xx, what happened)."""
    headers = {}
    if key is not None:
        if not key_safe_url(url):
            return False, "not sent: the run key goes only over https or to loopback"
        headers = bearer_header(key)
    try:
        with _NO_PROXY.open(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
            return 200 <= resp.status < 300, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def engine_key(spec: EngineSpec) -> str | None:
    """The run key for ``spec``'s engines (None when keyless); EngineStartError when missing."""
    if spec.auth is None:
        return None
    try:
        return run_key()
    except MissingRunKeyError as exc:
        raise EngineStartError(f"{spec.name}: its server needs the run key (auth='bearer'); {exc}") from None


class EnginePool(ABC):
    """Port. ``addresses`` holds the base URLs after ``start()``, in engine order."""

    backend: str

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.addresses: list[str] = []
        self._key: str | None = None

    @abstractmethod
    def start(self) -> list[str]:
        """Start every engine and wait for health; on failure stop all and raise EngineStartError."""

    @abstractmethod
    def stop(self) -> None:
        """End every engine (idempotent)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What ``start`` would do, JSON-able, touching nothing."""

    def __enter__(self) -> list[str]:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def get_engine_pool(spec: EngineSpec, backend: str = "local", **kwargs: Any) -> EnginePool:
    if backend == "local":
        return LocalEnginePool(spec, **kwargs)
    if backend == "modal":
        from modal_rl.cluster.engines_modal import ModalEnginePool

        return ModalEnginePool(spec, **kwargs)
    raise ValueError(f"unknown engine backend {backend!r}; choose 'local' or 'modal'")


@contextlib.contextmanager
def running(spec: EngineSpec, backend: str = "local", **kwargs: Any) -> Iterator[list[str]]:
    """Engines up for the body's duration; addresses yielded; all stopped on any exit."""
    with get_engine_pool(spec, backend, **kwargs) as addresses:
        yield addresses


class LocalEnginePool(EnginePool):
    """Engines as processes on 127.0.0.1, each on a free port, output to a log file each.

    Each engine runs in its own session (its process group is what ``stop`` signals), under
    ``setpriv --pdeathsig KILL`` where available (so a killed pool process takes its engines
    along), with ``MODAL_RL_RUN_ID`` set, so ``procs.end_run`` also finds children that left
    the group. ``GPU`` is not enforced here: the command decides what it runs on.
    """

    backend = "local"
    host = "127.0.0.1"

    def __init__(
        self, spec: EngineSpec, log_dir: str | None = None, poll_s: float = 0.2, grace_s: float = 5.0
    ):
        super().__init__(spec)
        self.run_id = uuid.uuid4().hex[:12]
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"mrl-engines-{self.run_id}-"))
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []

    def log_path(self, index: int) -> Path:
        return self.log_dir / f"{self.spec.name}-{index}.log"

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.spec.env, procs.RUN_ID_ENV: self.run_id, "PYTHONUNBUFFERED": "1"}
        for name in KEY_ENVS:  # a keyless server gets no key; a keyed one only ours
            env.pop(name, None)
        if self._key is not None:
            env[RUN_KEY_ENV] = self._key
        return env

    def describe(self) -> dict[str, Any]:
        auth = (
            "bearer key required (Authorization: Bearer <run key>; each engine gets the key as "
            f"{RUN_KEY_ENV} in its environment); plain http on 127.0.0.1 only"
            if self.spec.auth
            else "none (keyless server, explicitly asked for); plain http on 127.0.0.1 only"
        )
        return {
            "backend": self.backend,
            "spec": self.spec.to_dict(),
            "commands": [self.spec.argv(self.host, 0) for _ in range(self.spec.count)],
            "auth": auth,
            "note": "each engine gets a free port on 127.0.0.1 at start ({port} above shows 0)",
        }

    def start(self) -> list[str]:
        from modal_rl.cluster.backend_local import free_ports

        self._key = engine_key(self.spec)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ports = free_ports(self.spec.count, self.host)
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        try:
            for index, port in enumerate(self.ports):
                with open(self.log_path(index), "wb") as log:
                    self.procs.append(
                        spawn(
                            prefix + self.spec.argv(self.host, port),
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env=self._env(),
                            start_new_session=True,
                        )
                    )
            self._wait_all()
        except BaseException:
            self.stop()
            raise
        self.addresses = [f"http://{self.host}:{port}" for port in self.ports]
        return list(self.addresses)

    def _wait_all(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        pending = set(range(self.spec.count))
        last: dict[int, str] = {}
        while pending:
            for index in sorted(pending):
                code = self.procs[index].poll()
                if code is not None:
                    raise EngineStartError(
                        self._failure(index, f"exited with code {code} before it was healthy")
                    )
                url = f"http://{self.host}:{self.ports[index]}{self.spec.health_path}"
                ok, last[index] = probe(url, key=self._key)
                if ok:
                    pending.discard(index)
            if not pending:
                return
            if time.monotonic() > deadline:
                index = min(pending)
                raise EngineStartError(
                    self._failure(
                        index,
                        f"did not answer GET {self.spec.health_path} within {self.spec.startup_timeout_s:g} s "
                        f"(last: {last.get(index)})",
                    )
                )
            time.sleep(self.poll_s)

    def _failure(self, index: int, why: str) -> str:
        tail = [redact(line, self._key) for line in tail_of(self.log_path(index))]
        return engine_failure(self.spec.name, index, why, tail)

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        survivors = procs.end_run(self.run_id, grace_s=1.0) if self.procs else []
        if survivors:
            print(f"[modal_rl.engines] could not end PIDs {survivors}", file=sys.stderr)
        self.procs = []
        self.addresses = []


_spawn_requests: queue.Queue = queue.Queue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def spawn(argv: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``Popen`` from one long-lived daemon thread.

    The kernel's parent-death signal fires when the *thread* that forked the child exits, not
    the process. Callers start pools from short-lived threads (``asyncio.to_thread``, executor
    threads torn down by ``asyncio.run``); forking from them would kill the engines early.
    """
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_loop, name="modal-rl-engine-spawner", daemon=True)
            _spawner.start()
    done: queue.Queue = queue.Queue(maxsize=1)
    _spawn_requests.put((argv, popen_kwargs, done))
    ok, value = done.get()
    if not ok:
        raise value
    return value


def _spawn_loop() -> None:
    while True:
        argv, kwargs, done = _spawn_requests.get()
        try:
            done.put((True, subprocess.Popen(argv, **kwargs)))
        except BaseException as exc:  # handed to the caller's thread
            done.put((False, exc))


def tail_of(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return []


def engine_failure(name: str, index: int, why: str, tail: list[str]) -> str:
    body = "\n".join(f"  | {line}" for line in tail) or "  | (no output)"
    return f"{name} {index} {why}; its last lines:\n{body}"
