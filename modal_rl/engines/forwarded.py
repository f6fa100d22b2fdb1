"""Supervised engines behind fixed keyed ports, in one process: for a client that holds neither
the key nor a way to follow a replaced engine (slime's rollout manager).

``ForwardedEngines(pool, engine)`` starts ``pool`` under an ``EngineSupervisor`` and a
``KeyForwarder`` with one port per engine, whose event loop runs on a daemon thread of this
process. The client gets ``addresses`` (the forwarder's ``http://host:port``, one per engine)
and keeps them for the whole run. The supervisor's ``on_route`` points a port at its engine
directly (``KeyForwarder.route``): a lost engine's port holds its requests at once, and is
pointed at the replacement only after ``engine.catch_up(url)`` brought that one to the framework's
newest weights. No routes file is involved: supervisor and forwarder share this process, so the
same works wherever the process runs, whatever the pool's backend.

Health: the engines' process/container and ``GET`` of their health path
(``supervisor.paused``): a framework that pauses its engines around weight updates without
telling us (slime) would make a paused, healthy engine fail a generation probe.

Invariants:
- ``addresses`` never change while the engines run; each port forwards only to the engine
  that currently holds its slot, with the engine bearer in place of what the client sent;
- a port routes to a replacement only after ``catch_up`` returned for it (the supervisor's);
- ``start`` that fails stops what it started; ``stop`` is idempotent and ends the forwarder
  before the engines (no request reaches an engine being stopped through us).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from modal_rl.engines.base import Engine
from modal_rl.engines.key_forwarder import KeyForwarder
from modal_rl.engines.pool import EnginePool
from modal_rl.engines.state import FAILED, SERVING, EngineLost
from modal_rl.engines.supervisor import EngineSupervisor
from modal_rl.retry import wait_for

STOP_TIMEOUT_S = 30.0


class ForwardedEngines:
    def __init__(
        self,
        pool: EnginePool,
        engine: Engine | None,
        *,
        host: str = "127.0.0.1",
        allow_peers: list[str] | None = None,
        key: str | None = None,
        health: dict[str, Any] | None = None,
    ) -> None:
        self.pool = pool
        self.host, self.allow_peers, self.key = host, allow_peers, key
        self.supervisor = EngineSupervisor(pool, engine, on_route=self._route, **(health or {}))
        self.supervisor.paused = True  # see the module docstring: process + GET health only
        self.forwarder: KeyForwarder | None = None
        self.addresses: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> list[str]:
        """Start the engines (each up before it counts) and the forwarder; returns the
        forwarder's addresses, engine order."""
        try:
            upstreams = self.supervisor.start()
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="modal-rl-key-forwarder", daemon=True
            )
            self._thread.start()
            forwarder = KeyForwarder(upstreams, host=self.host, allow_peers=self.allow_peers, key=self.key)
            self.addresses = asyncio.run_coroutine_threadsafe(forwarder.start(), self._loop).result()
            with self._lock:  # an engine lost or replaced since the supervisor started
                serving = {engine.index: engine.url for engine in self.supervisor.routable()}
                for index in range(len(upstreams)):
                    forwarder.route(index, serving.get(index))
                self.forwarder = forwarder
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def wait_serving(self, timeout_s: float, poll_s: float = 0.1) -> None:
        """Return once no engine is being replaced or loading (every slot serves, or failed for
        good); ``EngineLost`` naming the slots when one failed for good or ``timeout_s`` passed."""
        for lease in self.supervisor.leases():  # an ended process is lost now, not at the next check
            if self.pool.alive(lease.index) is False:
                self.supervisor.report_failure(lease, "process ended")
        states: list[dict] = []

        def settled() -> bool:
            states[:] = self.supervisor.snapshot()
            return all(s["status"] in (SERVING, FAILED) for s in states)

        if not wait_for(settled, timeout_s, poll_s):
            where = ", ".join(f"{s['index']}:{s['status']}" for s in states)
            raise EngineLost(f"rollout engines not serving within {timeout_s:g} s ({where})")
        failed = [s["index"] for s in states if s["status"] == FAILED]
        if failed:
            raise EngineLost(f"rollout engine slot(s) {failed} could not be replaced")

    def _route(self, index: int, url: str | None) -> None:
        with self._lock:
            if self.forwarder is not None:
                self.forwarder.route(index, url)  # a plain assignment the port's handler reads

    def stop(self) -> None:
        with self._lock:
            forwarder, self.forwarder = self.forwarder, None
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        self.addresses = []
        try:
            if forwarder is not None and loop is not None:
                asyncio.run_coroutine_threadsafe(forwarder.stop(), loop).result(STOP_TIMEOUT_S)
        finally:
            if loop is not None:
                loop.call_soon_threadsafe(loop.stop)
                if thread is not None:
                    thread.join(STOP_TIMEOUT_S)
                loop.close()
            self.supervisor.stop()

    def __enter__(self) -> ForwardedEngines:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
