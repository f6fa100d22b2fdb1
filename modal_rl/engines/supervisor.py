"""Keeping a pool's engines serving the current weights: probe, replace, catch up, route.

``EngineSupervisor(pool, engine)`` wraps an ``EnginePool`` of ``engine``'s servers (an
``Engine``, the port in ``engines.base``). One monitor thread per engine
slot checks its engine every ``interval_s``: the process/container is still running
(``pool.alive``), and, unless a real request on it finished since the last check, it answers
a 1-token generation (``health.healthy``) within ``probe_timeout_s``. A dead engine
(exited, container finished) is *lost* at once; one that fails ``failures`` checks in a row
(hung: SIGSTOP, a wedged model) is lost then. So a loss is detected within ``interval_s`` of a
process exit (local; Modal: of the call finishing) and within ``failures x (interval_s +
probe_timeout_s)`` of a hang.

A lost engine is replaced in its slot's thread: ``pool.replace(i)`` (same spec; a new process
or function call), then ``engine.load(url, source)`` brings it to the pool's current weight version
(``WeightSource``: the frame server the engines pull from, and the version) -- an anchor plus
the deltas after it, through the weight-sync path -- and only then is it *serving*.

Engines whose weights the framework drives itself (slime pushes every version to its engines;
the supervisor never learns them) have ``engine.catch_up(url)`` instead: called for a replacement
before it serves, it brings the engine to the framework's newest version through the
framework's own weight path. ``on_route(index, url | None)`` tells a router outside the
supervisor (slime's key forwarder) when a slot stops taking traffic (lost: None) and where
its replacement is once it serves.

Routing (``acquire``) hands out only engines that are serving *and* hold the current version;
``set_source`` (a new version published) loads it into every serving engine, during which they
take no new requests. A caller whose request fails, or whose engine is no longer the one it
was given (``is_current``), retries on another engine of the same version or, when none comes
back within its bound, gets ``EngineLost``: the sample is then dropped and masked by the
adapter, never scored and never answered by older weights.

Observability (for benchmarks and chaos tests): ``events`` (dicts with wall-clock ``t``,
``kind`` in ``EVENT_KINDS``, ``index``, ``generation``, ``pid``, ``version``, ...),
``timings()`` (cold starts and recoveries in seconds), ``pids()``, ``snapshot()``.

Invariants:
- an engine whose version differs from the pool's current version is never handed out;
- a replacement takes traffic only after ``engine.load`` returned for the current version (checked
  again under the lock, so a version published during its catch-up is loaded too);
- a slot's loads are serialized (one catch-up or update at a time per engine), and probes
  pause while its engine loads weights (a load blocks the engine's steps);
- ``stop()`` ends the monitors and the pool; it is idempotent.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from modal_rl.engines.base import Engine
from modal_rl.engines.health import healthy
from modal_rl.engines.pool import EnginePool, EngineStartError
from modal_rl.engines.state import (  # noqa: F401  (EngineLost, WeightSource: re-exported)
    EVENT_KINDS,
    FAILED,
    LOADING,
    LOST,
    REPLACING,
    SERVING,
    EngineLease,
    EngineLost,
    EngineState,
    WeightSource,
)


class EngineSupervisor:
    def __init__(
        self,
        pool: EnginePool,
        engine: Engine | None = None,
        *,
        interval_s: float = 2.0,
        probe_timeout_s: float = 30.0,
        failures: int = 2,
        max_replacements: int = 3,
        on_route: Callable[[int, str | None], None] | None = None,
    ) -> None:
        self.pool = pool
        self.engine = engine  # None: servers without weight versions (never set_source)
        self.on_route = on_route
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.failures = failures
        self.max_replacements = max_replacements
        self.events: list[dict[str, Any]] = []
        self.engines: list[EngineState] = []
        self.source: WeightSource | None = None
        self.paused = False
        self._cond = threading.Condition()
        self._slot_locks: list[threading.Lock] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next = 0

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Start the pool (or take over one already started: its engines count as serving the
        weights they hold, version None), bring every engine to ``source`` if one is set, and
        start watching. ``started`` events carry ``cold_start_s`` (spawn -> serving the current
        version), ``up_s`` (spawn -> up) and ``load_s`` (the initial weight load)."""
        t0 = time.monotonic()
        addresses = list(self.pool.addresses) or self.pool.start()
        up_s = time.monotonic() - t0
        self.engines = [EngineState(i, url) for i, url in enumerate(addresses)]
        self._slot_locks = [threading.Lock() for _ in addresses]
        self._stop.clear()
        for engine in self.engines:
            t1 = time.monotonic()
            self._bring_to_current(engine)
            now = time.monotonic()
            self._event("started", engine, cold_start_s=now - t0, up_s=up_s, load_s=now - t1)
        self._threads = [
            threading.Thread(target=self._watch, args=(i,), name=f"engine-watch-{i}", daemon=True)
            for i in range(len(self.engines))
        ]
        for thread in self._threads:
            thread.start()
        return list(addresses)

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.probe_timeout_s + 5.0)
        self._threads = []
        self.pool.stop()

    def __enter__(self) -> EngineSupervisor:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- weights ------------------------------------------------------------------------------

    def set_source(self, source: WeightSource) -> list[dict]:
        """Make ``source.version`` the pool's current version and load it into every serving
        engine (engines being replaced load it before they serve). Returns the loads' results;
        an engine that fails to load is lost (and replaced), not an error here."""
        with self._cond:
            self.source = source
            targets = [e for e in self.engines if e.status == SERVING]
            self._cond.notify_all()
        self._event("version", None, version=source.version)
        results: list[dict] = []
        threads = [threading.Thread(target=lambda e=e: results.append(self._try_bring(e))) for e in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [r for r in results if r]

    def _try_bring(self, engine: EngineState) -> dict:
        try:
            return self._bring_to_current(engine)
        except Exception as exc:  # the engine could not load: lose and replace it
            self._lose(engine, engine.generation, f"weight load failed: {exc}")
            return {}

    def _bring_to_current(self, engine: EngineState) -> dict:
        """Load the current version into ``engine`` until it holds it; then it serves."""
        result: dict = {}
        with self._slot_locks[engine.index]:
            generation = engine.generation
            while True:
                with self._cond:
                    if engine.generation != generation or engine.status in (LOST, REPLACING, FAILED):
                        return result  # replaced meanwhile: its own catch-up takes over
                    source = self.source
                    if source is None or engine.version == source.version:
                        engine.status, engine.failures = SERVING, 0
                        self._cond.notify_all()
                        return result
                    engine.status = LOADING
                if self.engine is None:
                    raise RuntimeError("a weight version was set but the supervisor has no engine to load it")
                result = dict(self.engine.load(engine.url, source) or {})
                with self._cond:
                    if engine.generation == generation:
                        engine.version = source.version

    # -- routing ------------------------------------------------------------------------------

    def routable(self) -> list[EngineState]:
        with self._cond:
            return self._routable()

    def _routable(self) -> list[EngineState]:
        current = self.source.version if self.source else None
        return [e for e in self.engines if e.status == SERVING and e.version == current]

    def acquire(self, timeout_s: float, version: int | None | object = ...) -> EngineLease:
        """An engine that serves the current version (round robin), waiting up to ``timeout_s``
        for one; ``EngineLost`` when none comes (every slot failed, or the bound passed) or,
        with ``version`` given, when the current version is no longer that one (a retry must
        not be answered by other weights than the request started with)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                current = self.source.version if self.source else None
                if version is not ... and current != version:
                    raise EngineLost(f"the weights moved from v{version} to v{current} before a retry")
                ready = self._routable()
                if ready:
                    engine = ready[self._next % len(ready)]
                    self._next += 1
                    return EngineLease(engine.index, engine.generation, engine.url, engine.version)
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set() or all(e.status == FAILED for e in self.engines):
                    states = ", ".join(f"{e.index}:{e.status}@v{e.version}" for e in self.engines)
                    raise EngineLost(
                        f"no engine serves the current weights within {timeout_s:g} s ({states})"
                    )
                self._cond.wait(min(left, 1.0))

    async def run(self, send, *, wait_s: float, attempts: int = 3, check_s: float = 0.5, transient=()):
        """``request_retry.run``: send a request with retries on the same weight version."""
        from modal_rl.engines.request_retry import run

        return await run(self, send, wait_s=wait_s, attempts=attempts, check_s=check_s, transient=transient)

    def leases(self) -> list[EngineLease]:
        """The engines that are up now (serving or loading), whatever version they hold: for
        control calls that every engine must get (pause, sleep, ...)."""
        with self._cond:
            return [
                EngineLease(e.index, e.generation, e.url, e.version)
                for e in self.engines
                if e.status in (SERVING, LOADING)
            ]

    def is_current(self, lease: EngineLease) -> bool:
        """Whether ``lease``'s engine is still the one handed out, serving the same version."""
        engine = self.engines[lease.index]
        return engine.generation == lease.generation and engine.status in (SERVING, LOADING)

    def finished(self, lease: EngineLease) -> None:
        """A request on ``lease`` completed: the engine evidently generates (spares a probe)."""
        engine = self.engines[lease.index]
        if engine.generation == lease.generation:
            engine.progress += 1

    def report_failure(self, lease: EngineLease, why: str) -> None:
        """A request on ``lease`` failed at the transport: check that engine now."""
        engine = self.engines[lease.index]
        if engine.generation != lease.generation or engine.status != SERVING:
            return
        if self.pool.alive(lease.index) is False:
            self._lose(engine, lease.generation, f"process ended ({why})")
            return
        ok, what = healthy(engine.url, self.pool.spec, self.pool._key, min(self.probe_timeout_s, 10.0))
        if not ok:
            self._lose(engine, lease.generation, f"request failed ({why}); then {what}")

    # -- monitoring and replacement -----------------------------------------------------------

    def _watch(self, index: int) -> None:
        engine = self.engines[index]
        attempts = 0
        while not self._stop.wait(self.interval_s):
            if engine.status in (LOST, REPLACING):
                if attempts >= self.max_replacements:
                    with self._cond:
                        engine.status = FAILED
                        self._cond.notify_all()
                    self._event("replace_failed", engine, why=f"gave up after {attempts} replacements")
                    return
                attempts += 1
                if self._replace(engine):
                    attempts = 0
                continue
            if engine.status == SERVING:
                self._check(engine)

    def _check(self, engine: EngineState) -> None:
        generation = engine.generation
        if self.pool.alive(engine.index) is False:
            self._lose(engine, generation, "process ended")
            return
        if engine.progress:
            engine.progress, engine.failures = 0, 0
            return
        if self.paused:  # paused/asleep engines hold generations: check the server only
            from modal_rl.engines.health import probe

            ok, what = probe(engine.url + self.pool.spec.health_path, self.probe_timeout_s, self.pool._key)
        else:
            ok, what = healthy(engine.url, self.pool.spec, self.pool._key, self.probe_timeout_s)
        if ok or engine.generation != generation or engine.status != SERVING:
            engine.failures = 0
            return
        engine.failures += 1
        if engine.failures >= self.failures:
            self._lose(engine, generation, f"{engine.failures} failed health checks, last: {what}")

    def _lose(self, engine: EngineState, generation: int, why: str) -> None:
        with self._cond:
            if engine.generation != generation or engine.status in (LOST, REPLACING, FAILED):
                return
            engine.status, engine.lost_at = LOST, time.monotonic()
            self._cond.notify_all()
        self._event("lost", engine, why=why)
        self._route(engine.index, None)

    def _replace(self, engine: EngineState) -> bool:
        with self._cond:
            engine.status = REPLACING
            engine.generation += 1
            engine.version = None
            self._cond.notify_all()
        t0 = time.monotonic()
        try:
            url = self.pool.replace(engine.index)
        except EngineStartError as exc:
            self._event("replace_failed", engine, why=str(exc).splitlines()[0])
            return False
        with self._cond:
            engine.url, engine.status, engine.failures, engine.progress = url, LOADING, 0, 0
        self._event("replaced", engine, up_s=time.monotonic() - t0, url=url)
        t1 = time.monotonic()
        try:
            caught = self.engine.catch_up(url) if self.engine is not None else {}
            if caught:
                self._event("caught_up", engine, **caught)
            self._bring_to_current(engine)
        except Exception as exc:
            self._lose(engine, engine.generation, f"catch-up failed: {exc}")
            return False
        if engine.status != SERVING:
            return False  # lost again during the catch-up: the next round replaces it
        now = time.monotonic()
        self._event("serving", engine, recovery_s=now - (engine.lost_at or t0), catch_up_s=now - t1)
        self._route(engine.index, url)
        return True

    def _route(self, index: int, url: str | None) -> None:
        if self.on_route is not None:
            try:
                self.on_route(index, url)
            except Exception as exc:  # a router that cannot be told is reported, never fatal here
                self._event("route_failed", None, index=index, why=f"{type(exc).__name__}: {exc}")

    # -- observability ------------------------------------------------------------------------

    def _event(self, kind: str, engine: EngineState | None, **fields: Any) -> None:
        event: dict[str, Any] = {"t": time.time(), "kind": kind}
        if engine is not None:
            event.update(index=engine.index, generation=engine.generation, version=engine.version)
            with contextlib.suppress(Exception):
                event["pid"] = self.pool.pid(engine.index)
        event.update(fields)
        self.events.append(event)

    def pids(self) -> list[int | None]:
        return [self.pool.pid(i) for i in range(len(self.engines))]

    def snapshot(self) -> list[dict[str, Any]]:
        with self._cond:
            return [asdict(e) for e in self.engines]

    def timings(self) -> dict[str, list[float]]:
        """Seconds: ``cold_start_s`` (start -> serving the current version, per engine at start),
        ``recovery_s`` (loss detected -> replacement serving the current version)."""
        pick = lambda kind, key: [e[key] for e in self.events if e["kind"] == kind]  # noqa: E731
        return {"cold_start_s": pick("started", "cold_start_s"), "recovery_s": pick("serving", "recovery_s")}
