"""Our per-step numbers into verl's own ``metrics`` dict, so every tracker verl logs to
(``trainer.logger=[console,tensorboard]``, ``wandb``, ``mlflow``, ``file``) shows them.

:func:`install` runs in verl's TaskRunner process (``verl_modal.runner``) and wraps two
verl methods there, class-wide:

- ``CheckpointEngineManager.update_weights`` (every weight sync, both of a separate-async
  trainer's managers included): times the sync, keeps the sender's numbers it returns, asks
  each rollout worker for its receiver's and engine adapter's numbers of that sync
  (``__ray_call__``, so any worker class works), and each replica that has an engine
  supervisor for its new events;
- ``Tracking.log``: on a training step's call (its data has ``training/global_step``), adds
  the ``modal_rl/...`` numbers (:mod:`modal_rl.report.numbers`) gathered since the previous
  step, from the syncs above and from the run's parts directory (:data:`PARTS_ENV`): the
  sandbox reward processes' snapshots (``sandbox-reward-<pid>.json``) and the masked
  samples (``masks-<pid>.jsonl``, :func:`record_mask`).

Invariants: both wrappers call verl's own method first and never change its result or
raise because of us (a number we cannot get is left out and logged once); installing twice
is a no-op; the parts directory is read on this machine only, so on a multi-node cluster a
reward or agent-loop process on another node is not counted (the weight-sync and engine
numbers come over Ray and are complete).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

from modal_rl.report import numbers
from modal_rl.report.parts import PARTS_ENV, PartsReader, parts_dir, record_events, record_mask

__all__ = ["PARTS_ENV", "SANDBOX_ENV", "Collector", "install", "record_mask"]
log = logging.getLogger("verl_modal")
SANDBOX_ENV = "MODAL_RL_SANDBOX_METRICS_DIR"  # verl_modal.reward_manager.METRICS_ENV
_MARK = "__modal_rl_step_metrics__"


def _worker_numbers(worker) -> dict:
    """Runs inside a rollout worker (``__ray_call__``): its last sync's numbers."""
    engine = getattr(worker, "checkpoint_engine", None)
    adapter = getattr(worker, "server_adapter", None)
    return {
        "rank": getattr(engine, "rank", None),
        "receiver": dict(getattr(engine, "metrics", None) or {}),
        "adapter": {
            k: float(v)
            for k, v in (getattr(adapter, "metrics", None) or {}).items()
            if isinstance(v, int | float)
        },
        "replica": getattr(adapter, "replica_rank", None),
    }


def _colocated_numbers(worker) -> dict:
    """Runs inside a colocated actor/rollout worker (``__ray_call__``): its rollout adapter's
    numbers of the last sync (``verl_modal.colocated_sync``), found on the worker itself or on
    the role it fuses (verl's colocated worker classes keep roles in ``worker_dict``)."""
    candidates = [worker, *list((getattr(worker, "worker_dict", None) or {}).values())]
    for w in candidates:
        adapter = getattr(w, "rollout", None)
        numbers = getattr(adapter, "metrics", None)
        if numbers:
            return {
                "replica": getattr(adapter, "replica_rank", None),
                "numbers": {k: float(v) for k, v in numbers.items() if isinstance(v, int | float)},
            }
    return {}


class Collector:
    """What happened since the last logged step, in the TaskRunner process."""

    def __init__(self, full_mib: float | None, parts: Path | None):
        self.full_mib = full_mib
        self.parts = parts
        self.reader = PartsReader(parts)
        self.lock = threading.Lock()
        self.syncs: list[numbers.SyncRecord] = []
        self.events: list[dict] = []
        self.seen_events: dict[Any, int] = {}
        self.sandbox_before: dict[str, dict] = {}
        self.warned: set[str] = set()

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self.warned:
            self.warned.add(what)
            log.warning("modal_rl step metrics: %s unavailable (%s: %s)", what, type(exc).__name__, exc)

    async def after_sync(self, manager, seconds: float, sender: dict | None) -> None:
        import asyncio

        rec = numbers.SyncRecord(seconds=seconds, sender=dict(sender or {}), full_mib=self.full_mib)
        if getattr(manager, "backend", "naive") == "naive":
            await self._colocated(manager, rec)
        else:
            workers = [
                w for r in list(getattr(manager, "replicas", [])) for w in list(getattr(r, "workers", []))
            ]
            try:  # one round trip for all of them: the trainer waits for this
                answers = await asyncio.gather(*(w.__ray_call__.remote(_worker_numbers) for w in workers))
            except Exception as exc:  # a worker gone mid-run: the sync's other numbers stay
                self._warn_once("receiver numbers", exc)
                answers = []
            for got in answers:
                if got["receiver"] and got["rank"] is not None:
                    rec.receivers[int(got["rank"])] = got["receiver"]
                if got["adapter"] and got["replica"] is not None:
                    rec.adapters[int(got["replica"])] = got["adapter"]
        new_events = []
        for replica in list(getattr(manager, "replicas", [])):
            if not hasattr(replica, "engine_events"):
                continue
            try:
                events = await replica.engine_events()
            except Exception as exc:
                self._warn_once("engine events", exc)
                continue
            key = getattr(replica, "replica_rank", id(replica))
            with self.lock:
                seen = self.seen_events.get(key, 0)  # shared by both managers of separate_async
                self.seen_events[key] = len(events)
            new_events += [{**e, "replica": key} for e in events[seen:]]
        with self.lock:
            self.syncs.append(rec)
            self.events += new_events
        record_events(self.parts, new_events)  # the report's timeline

    async def _colocated(self, manager, rec: numbers.SyncRecord) -> None:
        """A colocated sync: the sender's numbers are on the rollout adapters beside the
        trainer ranks (verl's manager returns none for ``naive``); without them the sync
        counts as a full copy."""
        import asyncio

        workers = list(getattr(getattr(manager, "actor_wg", None), "workers", None) or [])
        try:
            answers = await asyncio.gather(*(w.__ray_call__.remote(_colocated_numbers) for w in workers))
        except Exception as exc:
            self._warn_once("colocated sync numbers", exc)
            return
        for got in answers:
            if not got:
                continue
            got_numbers = dict(got["numbers"])
            pause = got_numbers.pop("pause_s", None)
            if not rec.sender:
                rec.sender = {k: v for k, v in got_numbers.items() if k.startswith("checkpoint_engine/")}
            if pause is not None and got["replica"] is not None:
                rec.adapters[int(got["replica"])] = {"pause_s": pause}

    def drain(self) -> dict[str, float]:
        """This step's ``modal_rl/`` numbers; resets the per-step counters."""
        with self.lock:
            syncs, self.syncs = self.syncs, []
            events, self.events = self.events, []
        out = numbers.weight_sync(syncs)
        if self.parts is not None:  # without a parts dir the masks are not seen: no number, not 0
            out.update(numbers.masked(self.reader.new_masks()))
        if self.seen_events:  # a replica with an engine supervisor answered at least once
            out.update(numbers.engines(events))
        now = self.reader.sandbox_snapshots()
        out.update(numbers.sandbox(self.sandbox_before, now))
        self.sandbox_before = now
        return out


_collector: Collector | None = None


def collector() -> Collector | None:
    return _collector


def install(config) -> Collector:
    """Wrap verl's sync and logging methods in this process (module docstring); idempotent."""
    global _collector
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.utils.ray_utils import auto_await
    from verl.utils.tracking import Tracking

    from verl_modal.model_size import full_weights_mib

    if _collector is not None:
        return _collector
    _collector = Collector(full_weights_mib(config), parts_dir())
    col = _collector

    inner = getattr(CheckpointEngineManager.update_weights, "__wrapped__", None)
    if inner is not None and not getattr(inner, _MARK, False):

        @functools.wraps(inner)
        async def update_weights(self, *args, **kwargs):
            t0 = time.perf_counter()
            result = await inner(self, *args, **kwargs)
            try:
                await col.after_sync(
                    self, time.perf_counter() - t0, result if isinstance(result, dict) else None
                )
            except Exception as exc:
                col._warn_once("weight-sync numbers", exc)
            return result

        setattr(update_weights, _MARK, True)
        CheckpointEngineManager.update_weights = auto_await(update_weights)
    elif inner is None:  # a verl whose manager is not auto_await-wrapped: say so, log the rest
        log.warning(
            "modal_rl step metrics: verl's CheckpointEngineManager.update_weights has no "
            "__wrapped__; weight-sync numbers are not logged on this verl"
        )

    original_log = Tracking.log
    if not getattr(original_log, _MARK, False):

        @functools.wraps(original_log)
        def tracking_log(self, data, step, backend=None):
            if isinstance(data, dict) and "training/global_step" in data:
                try:
                    data = {**data, **col.drain()}
                except Exception as exc:
                    col._warn_once("step numbers", exc)
            return original_log(self, data, step, backend=backend)

        setattr(tracking_log, _MARK, True)
        Tracking.log = tracking_log
    return col
