"""The per-step numbers modal-rl's parts know, as flat ``modal_rl/...`` metrics.

One set of names for both frameworks: verl gets them in the ``metrics`` dict it hands its
tracker (``verl_modal.step_metrics``), slime through its own logging path
(``slime_modal.step_metrics``). The functions here are pure: each takes what a part
recorded since the previous step and returns the step's numbers.

Invariants:
- every name starts with :data:`PREFIX`; values are plain floats (a tracker takes them as
  scalars);
- counters are per step (what happened since the last logged step), gauges are the value
  at log time; the docstring of each function says which;
- a part that did not run in this job contributes no names (a run without sandboxes has no
  ``modal_rl/sandbox/*``); weight sync is reported every step, zero included, and masking
  too where the masks can be seen (a run with a parts directory, :mod:`.parts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PREFIX = "modal_rl/"
WS = PREFIX + "weight_sync/"
SB = PREFIX + "sandbox/"
MASK = PREFIX + "masked/"
ENG = PREFIX + "engines/"


@dataclass
class SyncRecord:
    """One weight sync as the trainer saw it.

    ``sender``: the publishing engine's numbers (``checkpoint_engine/*`` of
    ``verl_modal.checkpoint_engine``), empty for a backend that reports none; ``receivers``:
    rank -> that receiver's numbers; ``adapters``: replica -> the engine's load numbers
    (``pause_s``: how long the engine stopped serving); ``seconds``: the trainer's wall time
    for the whole sync, during which the rollout does not generate; ``full_mib``: what a
    full copy of the weights is (the size of a sync that reports no payload of its own).
    ``seconds`` None: the sync's time is not known to the logging process (slime's disk
    path), and the step then has no ``seconds`` / ``engine_pause_s``."""

    seconds: float | None
    sender: dict[str, float] = field(default_factory=dict)
    receivers: dict[int, dict[str, float]] = field(default_factory=dict)
    adapters: dict[int, dict[str, float]] = field(default_factory=dict)
    full_mib: float | None = None


def _f(value: Any, default: float = 0.0) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def weight_sync(records: list[SyncRecord]) -> dict[str, float]:
    """Counters over this step's syncs (``syncs``, ``anchors``, ``deltas``, ``sent_mib``,
    ``raw_mib``, ``seconds``, ``engine_pause_s``, ``refused_frames``, per receiver
    ``receiver/<rank>/{mib,fetch_s,decode_s}``) and the gauge ``version`` (the last one
    published; absent for a backend without versions). A sync whose engine reports no
    payload (verl's ``naive``: the whole state every time) counts as an anchor of
    ``full_mib``. ``engine_pause_s``: the engines' own serving pause where they report one,
    else the trainer's sync time (the rollout is paused for all of it)."""
    out = {
        WS + "syncs": float(len(records)),
        WS + "anchors": 0.0,
        WS + "deltas": 0.0,
        WS + "sent_mib": 0.0,
        WS + "raw_mib": 0.0,
        WS + "seconds": 0.0,
        WS + "engine_pause_s": 0.0,
        WS + "refused_frames": 0.0,
    }
    if any(rec.seconds is None for rec in records):
        del out[WS + "seconds"], out[WS + "engine_pause_s"]
    for rec in records:
        s = rec.sender
        payload = s.get("checkpoint_engine/payload_mbytes")
        if payload is None:
            out[WS + "anchors"] += 1
            out[WS + "sent_mib"] += _f(rec.full_mib)
            out[WS + "raw_mib"] += _f(rec.full_mib)
        else:
            anchor = _f(s.get("checkpoint_engine/anchor")) > 0
            out[WS + ("anchors" if anchor else "deltas")] += 1
            out[WS + "sent_mib"] += _f(payload)
            out[WS + "raw_mib"] += _f(s.get("checkpoint_engine/raw_mbytes"), _f(payload))
        if "checkpoint_engine/version" in s:
            out[WS + "version"] = _f(s["checkpoint_engine/version"])
        pauses = [_f(a.get("pause_s")) for a in rec.adapters.values() if "pause_s" in a]
        if WS + "seconds" in out:
            out[WS + "seconds"] += rec.seconds
            out[WS + "engine_pause_s"] += max(pauses) if pauses else rec.seconds
        for rank, r in sorted(rec.receivers.items()):
            out[WS + "refused_frames"] += _f(r.get("checkpoint_engine/refused"))
            base = f"{WS}receiver/{rank}/"
            for name, key in (("mib", "payload_mbytes"), ("fetch_s", "fetch_s"), ("decode_s", "decode_s")):
                out[base + name] = out.get(base + name, 0.0) + _f(r.get("checkpoint_engine/" + key))
    return out


def sandbox(before: Mapping[str, dict], now: Mapping[str, dict]) -> dict[str, float]:
    """From the reward processes' snapshots (``sandbox-reward-<pid>.json``: counters since
    start and their pool's snapshot), keyed by file: counters over this step (``samples``,
    ``execs``, ``errors``, ``lease_wait_s``) and, summed over pools, the gauges ``pool_live``,
    ``pool_warm``, ``pool_target`` (the adaptive sizer's target), ``leased``; latency gauges
    (``lease_wait_p50_s``/``p99``, ``create_p50_s``/``p99``: the pools' recent windows) are
    the worst pool's. Empty when no reward process wrote a snapshot."""
    if not now:
        return {}
    out = {
        SB + k: 0.0
        for k in (
            "samples",
            "execs",
            "errors",
            "lease_wait_s",
            "pool_live",
            "pool_warm",
            "pool_target",
            "leased",
        )
    }
    worst: dict[str, float] = {}
    for name, snap in now.items():
        prev = before.get(name) or {}
        pool, prev_pool = snap.get("pool") or {}, prev.get("pool") or {}
        out[SB + "samples"] += _f(snap.get("samples")) - _f(prev.get("samples"))
        out[SB + "execs"] += _f(snap.get("execs")) - _f(prev.get("execs"))
        out[SB + "errors"] += _f(snap.get("sandbox_errors")) - _f(prev.get("sandbox_errors"))
        out[SB + "lease_wait_s"] += _f(pool.get("consumer_wait_s")) - _f(prev_pool.get("consumer_wait_s"))
        out[SB + "pool_live"] += _f(pool.get("live"))
        out[SB + "pool_warm"] += _f(pool.get("warm"))
        out[SB + "leased"] += _f(pool.get("leased"))
        out[SB + "pool_target"] += _f((pool.get("sizing") or {}).get("target"))
        for ours, theirs in (
            ("lease_wait_p50_s", "claim_p50_s"),
            ("lease_wait_p99_s", "claim_p99_s"),
            ("create_p50_s", "ready_p50_s"),
            ("create_p99_s", "ready_p99_s"),
        ):
            if pool.get(theirs) is not None:
                worst[ours] = max(worst.get(ours, 0.0), _f(pool[theirs]))
    out.update({SB + k: v for k, v in worst.items()})
    return out


MASK_CAUSES = ("sandbox", "bad_tests", "internal", "engine")


def masked(causes: Iterable[str]) -> dict[str, float]:
    """Counters over this step: samples left out of the loss, in all and per cause
    (``sandbox``: its sandbox failed after retries; ``bad_tests``: its tests were no tests;
    ``internal``: our own error while scoring it; ``engine``: its engine died mid-request)."""
    causes = list(causes)
    out = {MASK + "samples": float(len(causes))}
    out.update({MASK + c: float(sum(1 for x in causes if x == c)) for c in MASK_CAUSES})
    return out


def engines(events: Iterable[dict]) -> dict[str, float]:
    """Counters over this step from the engine supervisors' new events: ``replacements``
    (engines replaced), ``lost``, ``recovery_s`` (the longest loss-to-serving time of an
    engine back in service this step, 0 when none)."""
    events = list(events)
    recovery = [_f(e.get("recovery_s")) for e in events if e.get("kind") == "serving" and "recovery_s" in e]
    return {
        ENG + "replacements": float(sum(1 for e in events if e.get("kind") == "replaced")),
        ENG + "lost": float(sum(1 for e in events if e.get("kind") == "lost")),
        ENG + "recovery_s": max(recovery, default=0.0),
    }


def ours(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The ``modal_rl/`` entries of a step's metrics dict."""
    return {k: _f(v) for k, v in metrics.items() if str(k).startswith(PREFIX)}
