"""One RL loop over a :class:`~modal_rl.asyncrl.engine_client.VersionedEngine`, synchronous or
asynchronous, with the same engine, prompts and trainer step -- so the two can be compared.

- ``sync``: each step generates its groups, then trains, then commits the new version; the
  engine idles while the trainer works and the trainer idles while the engine generates.
- ``async``: producer threads keep groups generating, admitted by a
  :class:`~modal_rl.asyncrl.pacing.StalenessPacer` (``max_staleness``); the trainer takes the
  oldest complete groups, trains, and commits the new version in place while the producers'
  requests are still decoding (``running`` decides what those requests see).

``train(step, samples)`` is the trainer: it returns the new weights (a name -> tensor dict)
that become version ``step + 1``. Every consumed sample is stamped with the versions its
tokens came from (read from the engine) and its staleness is ``step - first version``;
``step_metrics`` holds each step's ``modal_rl/async/...`` numbers (``asyncrl.metrics``:
token-weighted staleness, versions per sample, engine idle and trainer wait seconds).
``commits_during_generation`` counts the versions that landed inside a consumed sample (from
the samples' records, not from the engine's count of requests it held at the commit, which
includes requests that had just made their last token).

Invariants: in ``async`` mode no consumed group started more than ``max_staleness`` versions
behind the step that consumes it (the pacer's bound; the loop checks each sample's measured
first version against it and raises if the engine's record says otherwise); ``sync`` is
``max_staleness = 0``. A run's time (and the engine's busy time) ends with the last step's
commit; groups still generating then are finished and dropped from the report (not part of
any step).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from modal_rl.asyncrl.engine_client import Sample, VersionedEngine
from modal_rl.asyncrl.metrics import step_numbers
from modal_rl.asyncrl.pacing import StalenessPacer

MODES = ("sync", "async")


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 4
    groups_per_step: int = 2
    group_size: int = 2
    max_tokens: int = 32
    # Each group draws its length from [min_tokens, max_tokens] (seeded by its index): real
    # responses differ in length, and groups of one length all finish in the same decoding
    # step, so a commit would never find one of them mid-generation. None: every group is
    # max_tokens long.
    min_tokens: int | None = None
    max_staleness: int = 1
    producers: int = 2  # groups generating at once (async)
    temperature: float = 1.0


class BusyClock:
    """Seconds during which at least one request was in flight on the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._since = 0.0
        self.busy_s = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._open == 0:
                self._since = time.monotonic()
            self._open += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self.busy_s += time.monotonic() - self._since

    def now(self) -> float:
        """Busy seconds so far, the request in flight now included."""
        with self._lock:
            return self.busy_s + (time.monotonic() - self._since if self._open else 0.0)


class SampleSource:
    """Groups of ``group_size`` samples of one prompt, generated concurrently."""

    def __init__(self, engine: VersionedEngine, prompts: list[list[int]], cfg: LoopConfig) -> None:
        self.engine, self.prompts, self.cfg = engine, prompts, cfg
        self.clock = BusyClock()
        self._next = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(cfg.producers, cfg.groups_per_step) * cfg.group_size)

    def _one(self, prompt: list[int], max_tokens: int, min_version: int | None) -> Sample:
        with self.clock:
            return self.engine.generate(
                prompt, max_tokens, temperature=self.cfg.temperature, min_version=min_version
            )

    def length(self, index: int) -> int:
        """The response length of group ``index``: the same in every run and mode."""
        low = self.cfg.max_tokens if self.cfg.min_tokens is None else self.cfg.min_tokens
        return random.Random(index).randint(low, self.cfg.max_tokens)

    def group(self, min_version: int | None = None) -> list[Sample]:
        with self._lock:
            index = self._next
            self._next += 1
        prompt, n = self.prompts[index % len(self.prompts)], self.length(index)
        futures = [self._pool.submit(self._one, prompt, n, min_version) for _ in range(self.cfg.group_size)]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def run_loop(
    engine: VersionedEngine,
    pusher,
    prompts: list[list[int]],
    train: Callable[[int, list[Sample]], dict[str, Any]],
    mode: str,
    cfg: LoopConfig,
) -> dict[str, Any]:
    """Run ``cfg.steps`` trainer steps; the numbers of the run (one ``async.json`` row)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose sync or async")
    engine.versions()
    v0 = engine.committed  # the trainer's version 0 is what the engine holds now
    source = SampleSource(engine, prompts, cfg)
    bound = 0 if mode == "sync" else cfg.max_staleness
    stats: dict[str, Any] = {"staleness": [], "samples": 0, "with_versions": 0, "switched_to": set()}
    stats |= {"trainer_wait_s": 0.0, "pause_s": [], "switched_requests": 0, "train_s": 0.0, "commit_s": 0.0}
    stats["per_step"], stats["mark"] = [], (time.monotonic(), 0.0)  # (time, busy s) at the last commit

    def consume(step: int, samples: list[Sample], wait_s: float) -> None:
        stats["with_versions"] += engine.stamp(samples)
        stats["samples"] += len(samples)
        for s in samples:
            if s.versions is not None:
                lag = step - (s.versions.first - v0)
                if lag > bound:
                    raise RuntimeError(f"a sample started {lag} versions behind step {step} (bound {bound})")
                stats["staleness"].append(lag)
                stats["switched_to"].update(s.versions.versions[1:])  # commits inside this sample
        t_train = time.monotonic()
        state = train(step, samples)
        t_commit = time.monotonic()
        numbers = engine.commit(pusher, state)
        stats["train_s"] += t_commit - t_train
        stats["commit_s"] += time.monotonic() - t_commit
        stats["end"], stats["busy_s"] = time.monotonic(), source.clock.now()  # the run ends at a commit
        stats["pause_s"].append(float(numbers["pause_s"]))
        (t_last, busy_last), stats["mark"] = stats["mark"], (stats["end"], stats["busy_s"])
        idle = max(0.0, (stats["end"] - t_last) - (stats["busy_s"] - busy_last))
        lagged = [(s.versions, len(s.tokens), v0 + step) for s in samples]
        stats["per_step"].append(step_numbers(lagged, engine_idle_s=idle, trainer_wait_s=wait_s))
        stats["switched_requests"] += int(numbers.get("switched_requests", 0))

    t0 = time.monotonic()
    try:
        if mode == "sync":
            with ThreadPoolExecutor(cfg.groups_per_step) as groups:
                for step in range(cfg.steps):
                    t_wait = time.monotonic()
                    batch = [
                        f.result() for f in [groups.submit(source.group) for _ in range(cfg.groups_per_step)]
                    ]
                    waited = time.monotonic() - t_wait
                    stats["trainer_wait_s"] += waited
                    consume(step, [s for group in batch for s in group], waited)
        else:
            _run_async(engine, source, train, cfg, v0, stats, consume)
    finally:
        source.close()
    wall = stats["end"] - t0  # not the producers' leftover groups, finished after the last step
    lags = stats["staleness"]
    return {
        "mode": mode,
        "steps": cfg.steps,
        "step_s": wall / cfg.steps,
        "engine_busy_fraction": min(1.0, stats["busy_s"] / wall) if wall > 0 else 0.0,
        "trainer_wait_s": stats["trainer_wait_s"],
        "max_staleness": bound,
        "staleness_max": max(lags) if lags else None,
        "staleness_mean": sum(lags) / len(lags) if lags else None,
        "samples": stats["samples"],
        "samples_with_versions": stats["with_versions"],
        "commits_during_generation": len(stats["switched_to"]),
        "switched_requests": stats["switched_requests"],
        "pause_s_max": max(stats["pause_s"]) if stats["pause_s"] else None,
        "train_s": stats["train_s"],
        "commit_s": stats["commit_s"],
        "wall_s": wall,
        "step_metrics": stats["per_step"],  # one ``modal_rl/async/...`` dict per step
    }


def _run_async(engine, source: SampleSource, train, cfg: LoopConfig, v0: int, stats, consume) -> None:
    pacer = StalenessPacer(cfg.max_staleness, cfg.groups_per_step)
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            while not stop.is_set():
                group = pacer.admit_wait(lambda: engine.committed - v0, timeout=0.2)
                if group is None:
                    continue
                pacer.complete(group, source.group(min_version=v0 + group.start_version))
        except BaseException as exc:  # noqa: BLE001 -- reported by the trainer
            errors.append(exc)
            pacer.notify()

    producers = [threading.Thread(target=produce, daemon=True) for _ in range(cfg.producers)]
    for p in producers:
        p.start()
    try:
        for step in range(cfg.steps):
            t_wait = time.monotonic()
            groups = None
            while groups is None:
                if errors:
                    raise RuntimeError(f"a producer failed: {errors[0]}") from errors[0]
                groups = pacer.take_wait(timeout=1.0)
            waited = time.monotonic() - t_wait
            stats["trainer_wait_s"] += waited
            consume(step, [s for g in groups for s in g.samples], waited)
            pacer.notify()  # the engine holds a newer version: admissions may proceed
    finally:
        stop.set()
        pacer.notify()
        for p in producers:
            p.join(600)
