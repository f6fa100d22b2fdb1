"""The Engine port: everything the run asks of one kind of inference server.

An ``Engine`` is a driver for one kind of server (vLLM, SGLang, ...), configured once (model,
key, bounds) and used for every server of that kind in a pool: each call names the server by
its base URL (``http://127.0.0.1:port`` locally, ``https://...`` through a Modal tunnel).
Starting and ending the processes or containers is the pool's job (``engines.pool``); keeping
them serving the current weights is the supervisor's (``engines.supervisor``), which calls
``load`` and ``catch_up`` here. A new kind of server is one file with a subclass and one
``ENGINES.add`` line (``modal_rl.engines``; docs/extending.md).

What a user may call, and what each promises:

- ``argv()``: the server's launch command, a template with ``{host}`` and ``{port}`` left for
  the pool to fill (``EngineSpec.command``); it never holds a key (keys reach the server through
  its environment). ``spec(**pool)`` wraps it with the health request into an ``EngineSpec``.
- ``generate_request()``: the 1-token JSON POST that says the server is healthy
  (``EngineSpec.generate``), or None when ``GET health_path`` is all it can answer.
  ``health(url, timeout_s)`` runs that check once: ``(ok, what happened)``, never raises.
- ``stage(url, source)``: the server pulls ``source.version`` (a ``WeightSource``) while it
  keeps serving; returns when every worker holds it ready, or raises (its live weights
  unchanged). ``commit(url, version)``: the staged version goes live, then the prefix cache
  is reset; only a staged version can be committed. ``load(url, source)`` = both, and returns
  numbers (seconds, frames); after it returns the server answers with ``source.version``.
- ``catch_up(url)``: for servers whose weights the framework drives itself: bring a new
  server to the framework's newest version before it takes traffic. The default returns ``{}``
  (weights come through ``load``).
- ``pause(url)`` / ``resume(url)``: stop and restart scheduling, keeping requests in flight.
  ``reset_prefix_cache(url)``: drop cached prefixes (their keys/values came from older weights).
- ``load_adapter(url, name, path)`` / ``unload_adapter(url, name)``: LoRA adapters by name.
- ``stop()``: release what this driver holds (not the servers); idempotent.

Invariants: a capability a server lacks raises ``NotImplementedError`` whose one line names the
engine and the call; every HTTP call sends the engine bearer (derived from the run key, never
the key itself) only over https or to loopback, and is bounded in time; an error names the
server's URL, never the key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NoReturn


class Engine(ABC):
    """Port; see the module docstring. Subclasses set ``name`` and implement ``argv``."""

    name: ClassVar[str] = "engine"
    health_path: ClassVar[str] = "/health"
    port: ClassVar[int] = 8000

    def __init__(self, *, key: str | None = None) -> None:
        self.key = key  # the run key: the engine bearer is derived from it per call

    # -- launch ----------------------------------------------------------------------------

    @abstractmethod
    def argv(self) -> list[str]:
        """The launch command, ``{host}``/``{port}`` left open, no key on it."""

    def generate_request(self) -> dict[str, Any] | None:
        """``{"path": ..., "body": ...}``: a 1-token generation, or None (``GET health_path`` only)."""
        return None

    def env(self) -> dict[str, str]:
        """Environment the server needs beyond the keys the pool gives it."""
        return {}

    def spec(self, **pool: Any):
        """The ``EngineSpec`` a pool starts: this command, health request and environment;
        ``pool`` adds the pool's own settings (count, gpu, image, timeouts, name, ...)."""
        from modal_rl.engines.pool import EngineSpec

        env = {**self.env(), **dict(pool.pop("env", None) or {})}
        pool.setdefault("name", self.name)
        pool.setdefault("port", self.port)
        pool.setdefault("health_path", self.health_path)
        return EngineSpec(command=self.argv(), generate=self.generate_request(), env=env, **pool)

    # -- health ----------------------------------------------------------------------------

    def health(self, url: str, timeout_s: float) -> tuple[bool, str]:
        """One check of the server at ``url``: the generation when there is one, else
        ``GET health_path``; ``(ok, what happened)``."""
        from modal_rl.engines.health import generation_probe, probe

        generate = self.generate_request()
        if generate is None:
            return probe(url.rstrip("/") + self.health_path, timeout_s=timeout_s, key=self.key)
        return generation_probe(url, generate, self.key, timeout_s)

    # -- weights ---------------------------------------------------------------------------

    def stage(self, url: str, source: Any) -> dict[str, float]:
        self.unsupported("stage (pull a weight version while serving)")

    def commit(self, url: str, version: int) -> dict[str, float]:
        self.unsupported("commit (make a staged weight version live)")

    def load(self, url: str, source: Any) -> dict[str, float]:
        """Stage then commit; subclasses with a faster whole path override it."""
        return {**self.stage(url, source), **self.commit(url, source.version)}

    def catch_up(self, url: str) -> dict[str, Any]:
        """Bring a new server to the framework's newest weights; ``{}``: nothing to do here."""
        return {}

    # -- serving control -------------------------------------------------------------------

    def pause(self, url: str) -> None:
        self.unsupported("pause")

    def resume(self, url: str) -> None:
        self.unsupported("resume")

    def reset_prefix_cache(self, url: str) -> None:
        self.unsupported("reset_prefix_cache")

    def load_adapter(self, url: str, name: str, path: str) -> None:
        self.unsupported("load_adapter (LoRA)")

    def unload_adapter(self, url: str, name: str) -> None:
        self.unsupported("unload_adapter (LoRA)")

    def stop(self) -> None:
        """Release what this driver holds; the servers are the pool's. Idempotent."""
        return None

    # -- helpers ---------------------------------------------------------------------------

    def unsupported(self, what: str) -> NoReturn:
        raise NotImplementedError(f"engine {self.name!r} ({type(self).__name__}) does not support {what}")
