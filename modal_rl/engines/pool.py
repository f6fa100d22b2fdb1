"""Disaggregated inference engines: N servers (vLLM, SGLang, ...) on their own machines.

``EnginePool`` is the port: ``start()`` brings up ``spec.count`` servers, each running
``spec.command``, and returns their reachable base URLs (``http://127.0.0.1:port`` locally,
``https://...`` through a Modal TLS tunnel) in engine order; ``replace(i)`` ends engine ``i``
and starts a new one from the same spec (its address may change); ``stop()`` ends every one.
``running(spec, backend)`` is the context manager the adapters use.

Implementations: ``LocalEnginePool`` (``pool_local.py``: processes on 127.0.0.1) and
``ModalEnginePool`` (``pool_modal.py``: one Modal GPU container per engine, a TLS tunnel
each). Keeping engines *healthy* during a run (probing, replacing, bringing a replacement to
the current weights before it takes traffic) is ``supervisor.EngineSupervisor``'s job.

Health (``health``): an engine is up when ``GET spec.health_path`` answers 2xx *and*,
when ``spec.generate`` names a request, that request (a 1-token generation) answers 2xx; an
open port or a 200 on ``/health`` alone does not count then.

Auth (``spec.auth``): ``"bearer"`` (the default) says the server refuses requests without
``Authorization: Bearer <engine bearer>`` and reads the bearer from ``MODAL_RL_ENGINE_BEARER``
in its own environment (vLLM through ``auth.RunKeyAuth``; SGLang through
``keyed_launch``). The pool then needs the run's key to start (``run_key()``) and hands each
engine only what it needs, derived from it (``run_key.engine_env``: the bearer and the
frame-read key, never the run key or the Ray token), through the environment only (local: the
process env; Modal: a Modal Secret made for the run), and sends the bearer with every health
check. ``None`` is an explicitly keyless server: it gets no key at all.

Invariants:
- ``start()`` returns only when every engine is up (above), or raises ``EngineStartError``
  naming the engine, why, and its last log lines; in that case every engine it started has
  already been stopped (one bad engine never leaves the others running);
- ``stop()`` is idempotent and is also run by ``running()`` on errors and KeyboardInterrupt;
- ``spec.command`` is a template: ``{port}`` and ``{host}`` are filled per engine (the port
  an engine listens on, the interface it binds), nothing else is interpreted;
- the run key is never in ``spec`` (``env`` may not name it), ``to_dict()``, ``describe()``,
  a command line or an error message (engine log tails are redacted).
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modal_rl.cluster.spec import _ENV_RE, _NAME_RE, ClusterSpecError, GpuSpec
from modal_rl.modal_limits import MAX_MODAL_TIMEOUT_S
from modal_rl.registry import Registry
from modal_rl.run_key import SECRET_ENVS, MissingRunKeyError, run_key
from modal_rl.text_safety import clean

LOG_TAIL_LINES = 30
AUTH_MODES = ("bearer", None)
KEY_ENVS = SECRET_ENVS


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
    ``generate``: ``{"path": "/v1/completions", "body": {...}}``, a JSON POST asking for one
    token: what "healthy" means for this server (``health``); None: ``GET health_path``
    only (servers that cannot generate, e.g. stand-ins). ``cpus``: local engines only, the cores
    the server and every process it starts run on (``()``: every core this process may use); on
    a shared host a trainer beside the engine then keeps the other cores (``parse_cpus``).
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
    generate: dict[str, Any] | None = None
    # Whether the server pulls modal_rl weight frames (vLLM with our extension): only then does
    # it get the frame-read key beside its bearer (least privilege: SGLang's do not).
    pulls_frames: bool = True
    # Whether the server binds its port with SO_REUSEPORT (vLLM does): then the local pool holds
    # the port against other users until the server listens on it (``cluster.ports``).
    shares_port: bool = False
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(str(a) for a in self.command))
        object.__setattr__(self, "cpus", tuple(self.cpus))
        object.__setattr__(self, "secrets", tuple(self.secrets))
        object.__setattr__(self, "pip", tuple(str(p) for p in self.pip))
        object.__setattr__(self, "volumes", dict(self.volumes))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})
        if self.generate is not None:
            object.__setattr__(self, "generate", dict(self.generate))
        if self.max_containers is None:
            object.__setattr__(self, "max_containers", self.count)
        self._validate()

    def _validate(self) -> None:
        if not self.command:
            raise ClusterSpecError("engine command is empty")
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ClusterSpecError(f"engine count={self.count!r}: must be an integer >= 1")
        GpuSpec.parse(self.gpu)
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in self.cpus):
            raise ClusterSpecError(f"engine cpus={self.cpus!r}: must be core numbers >= 0")
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
        if self.generate is not None and (
            not str(self.generate.get("path", "")).startswith("/")
            or not isinstance(self.generate.get("body", {}), dict)
            or set(self.generate) - {"path", "body"}
        ):
            raise ClusterSpecError(
                f"engine generate={self.generate!r}: use {{'path': '/v1/completions', 'body': {{...}}}}"
            )
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
        data["cpus"] = list(self.cpus)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineSpec:
        return cls(**data)


def parse_cpus(text: str) -> tuple[int, ...]:
    """Cores as Linux writes them (``"1"``, ``"2-5"``, ``"0,2-3"``; ``""``: none named)."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())) or (sep and int(hi) < int(lo)):
            raise ClusterSpecError(f"engine cpus {text!r}: name cores like '1', '2-5' or '0,2-3'")
        cores += range(int(lo), int(hi if sep else lo) + 1)
    return tuple(sorted(set(cores)))


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
    def replace(self, index: int) -> str:
        """End engine ``index`` (dead, hung or alive) and start a new one from the same spec;
        returns its address once it is up (``health.ready``), else raises
        ``EngineStartError`` (the slot is then left without an engine)."""

    def alive(self, index: int) -> bool | None:
        """Whether engine ``index``'s process/container is still running; None: unknown here."""
        return None

    def pid(self, index: int) -> int | None:
        """The local process id of engine ``index`` (None on backends without one)."""
        return None

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


# Engine pools by backend name (``modal_rl.registry``: imported only when chosen; a package
# adds one through the ``modal_rl.engine_pools`` entry-point group).
ENGINE_POOLS = Registry("engine pool backend", group="modal_rl.engine_pools")
ENGINE_POOLS.add("local", "modal_rl.engines.pool_local:LocalEnginePool")
ENGINE_POOLS.add("modal", "modal_rl.engines.pool_modal:ModalEnginePool")


def get_engine_pool(spec: EngineSpec, backend: str = "local", **kwargs: Any) -> EnginePool:
    """The pool of ``spec``'s engines on ``backend``, made with ``kwargs``."""
    return ENGINE_POOLS.load(backend)(spec, **kwargs)


@contextlib.contextmanager
def running(spec: EngineSpec, backend: str = "local", **kwargs: Any) -> Iterator[list[str]]:
    """Engines up for the body's duration; addresses yielded; all stopped on any exit."""
    with get_engine_pool(spec, backend, **kwargs) as addresses:
        yield addresses


def tail_of(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return []


def engine_failure(name: str, index: int, why: str, tail: list[str]) -> str:
    """The error for a failed engine; its output lines are the engine's, so they are cleaned of
    terminal escapes (``text_safety``) before they reach a terminal."""
    body = "\n".join(f"  | {clean(line)}" for line in tail) or "  | (no output)"
    return f"{name} {index} {clean(why)}; its last lines:\n{body}"
