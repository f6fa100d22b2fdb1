"""A run folder for the report tests, written through verl's own ``file`` tracking backend
(``verl.utils.tracking.FileLogger``, the one a real run's ``metrics.jsonl`` comes from) with
step numbers made by :mod:`modal_rl.report.numbers` from recorded syncs, sandbox snapshots,
masks and engine events."""

from __future__ import annotations

import json
from pathlib import Path

from modal_rl.report import numbers as n
from modal_rl.report.run_dir import write_info


def sandbox_snapshot(samples: int, errors: int, wait_s: float, live: int, target: int) -> dict:
    """The shape ``verl_modal.reward_manager`` writes: counters and the pool's snapshot."""
    return {
        "samples": samples,
        "execs": 2 * samples,
        "sandbox_errors": errors,
        "pool": {
            "live": live,
            "warm": live - 1,
            "leased": 1,
            "claim_p50_s": 0.01 * live,
            "claim_p99_s": 0.05 * live,
            "ready_p50_s": 0.2,
            "ready_p99_s": 0.9,
            "consumer_wait_s": wait_s,
            "sizing": {"target": target},
        },
    }


def step_data(step: int) -> dict[str, float]:
    sender = {
        "checkpoint_engine/version": float(step),
        "checkpoint_engine/anchor": 1.0 if step == 1 else 0.0,
        "checkpoint_engine/payload_mbytes": 12.5 if step == 1 else 0.75 + step / 100,
        "checkpoint_engine/raw_mbytes": 12.5,
    }
    receiver = {
        "checkpoint_engine/payload_mbytes": sender["checkpoint_engine/payload_mbytes"],
        "checkpoint_engine/fetch_s": 0.02,
        "checkpoint_engine/decode_s": 0.01,
        "checkpoint_engine/refused": 1.0 if step == 2 else 0.0,
    }
    rec = n.SyncRecord(
        seconds=0.4 + step / 10, sender=sender, receivers={1: receiver}, adapters={0: {"pause_s": 0.05}}
    )
    data = {
        "training/global_step": step,
        "critic/score/mean": 0.1 * step + 0.0123,
        "response_length/mean": 20.0 + step,
        **n.weight_sync([rec]),
        **n.masked(["sandbox"] * (step - 1) + (["engine"] if step == 3 else [])),
        **n.sandbox(
            {"a": sandbox_snapshot(4 * (step - 1), 0, 0.1 * (step - 1), 3, 4)} if step > 1 else {},
            {"a": sandbox_snapshot(4 * step, step - 1, 0.1 * step, 3 + step, 4 + step)},
        ),
        **n.engines(
            [{"kind": "lost"}, {"kind": "replaced"}, {"kind": "serving", "recovery_s": 7.25}]
            if step == 2
            else []
        ),
    }
    return data


def make_run(run_dir: Path, steps: int = 3, monkeypatch=None) -> Path:
    """A run folder like a local verl run's: metrics.jsonl, run.json, engine events."""
    from verl.utils.tracking import FileLogger

    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    logger = FileLogger("p", "e")
    for step in range(1, steps + 1):
        logger.log(step_data(step), step)
    logger.finish()
    write_info(
        run_dir, "verl", {"algorithm.adv_estimator": "grpo", "trainer.total_training_steps": str(steps)}
    )
    (run_dir / "parts").mkdir(exist_ok=True)
    events = [
        {"t": 100.0, "kind": "started", "index": 0},
        {"t": 130.5, "kind": "lost", "index": 0},
        {"t": 131.0, "kind": "replaced", "index": 0},
        {"t": 137.75, "kind": "serving", "index": 0},
    ]
    (run_dir / "parts" / "engine-events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir
