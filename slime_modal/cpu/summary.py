"""The CPU main job's closing summary and its weight checks: ``python -m slime_modal.cpu.summary RUN``.

Reads the run folder (slime's tensorboard events, which slime's own logger wrote, and our
``metrics.jsonl``), prints one line per step and the summary, writes ``report.html``
(``modal_rl.report``) and checks that the weights SGLang samples with are the trainer's:

- **gap**: slime's ``train/train_rollout_logprob_abs_diff`` (the mean |log p_train - log p_engine|
  over the sampled tokens, the trainer recomputing what SGLang reported) stays at most
  ``--max-gap`` at every step. Each step's rollout used the weights of the previous sync, so a
  sync that did not reach the engine shows here as the gap of one update (0.1 and more at this
  learning rate, against about 1e-3 when synced);
- **moved**: SGLang's own mean log-prob of its samples changes by at least ``--min-move`` from
  the first step to the last (the engine's policy follows training);
- **deltas**: after the first version, the syncs were deltas (``modal_rl/weight_sync/deltas``).

Exit 0 when all pass; 1 with one line per failed check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GAP = "train/train_rollout_logprob_abs_diff"
ENGINE_LOGP = "rollout/rollout_log_probs"
REWARD = "rollout/raw_reward"
WS = "modal_rl/weight_sync/"


def tensorboard_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in the event files under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(Path(tb_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for e in acc.Scalars(tag):
                out.setdefault(tag, {})[int(e.step)] = float(e.value)
    return out


def jsonl_steps(path: Path) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                steps.setdefault(int(row["step"]), {}).update(row["data"])
            except (ValueError, KeyError, TypeError):
                continue
    return steps


def checks(
    gaps: dict[int, float],
    engine_logp: dict[int, float],
    ours: dict[int, dict[str, float]],
    max_gap: float,
    min_move: float,
) -> list[str]:
    """The failed checks, one line each (empty: all passed)."""
    failed = []
    if not gaps:
        failed.append(f"gap: slime logged no {GAP}; the run trained no step")
    bad = {s: g for s, g in sorted(gaps.items()) if g > max_gap}
    if bad:
        listed = ", ".join(f"step {s}: {g:.4f}" for s, g in bad.items())
        failed.append(
            f"gap: training vs rollout log-prob gap above {max_gap} ({listed}): SGLang sampled with other weights"
        )
    if len(engine_logp) >= 2:
        first, last = engine_logp[min(engine_logp)], engine_logp[max(engine_logp)]
        if abs(last - first) < min_move:
            failed.append(
                f"moved: SGLang's mean log-prob {first:.4f} -> {last:.4f} moved less than {min_move}"
            )
    else:
        failed.append("moved: fewer than two steps of SGLang log-probs")
    deltas = sum(d.get(WS + "deltas", 0.0) for d in ours.values())
    if len(ours) >= 2 and deltas < 1:
        failed.append("deltas: no delta reached the disk after the first version")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime_modal.cpu.summary", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--max-gap", type=float, default=0.05)
    parser.add_argument("--min-move", type=float, default=0.02)
    args = parser.parse_args(argv)
    run = args.run_dir
    tb = tensorboard_scalars(run / "tensorboard") if (run / "tensorboard").is_dir() else {}
    ours = jsonl_steps(run / "metrics.jsonl")
    gaps = tb.get(GAP, {})
    engine_logp = {s: d[ENGINE_LOGP] for s, d in ours.items() if ENGINE_LOGP in d} or tb.get(ENGINE_LOGP, {})
    for step in sorted(set(ours) | set(gaps)):
        d = ours.get(step, {})
        cols = [f"step {step}:"]
        if REWARD in d:
            cols.append(f"reward {d[REWARD]:.3f}")
        if step in engine_logp:
            cols.append(f"engine logprob {engine_logp[step]:.4f}")
        if step in gaps:
            cols.append(f"train-vs-engine gap {gaps[step]:.5f}")
        for label, key in (("anchors", "anchors"), ("deltas", "deltas"), ("MiB", "sent_mib")):
            if WS + key in d:
                cols.append(f"{label} {d[WS + key]:g}")
        print("[summary] " + " ".join(cols))
    if (run / "metrics.jsonl").is_file():
        from modal_rl.report.page import write

        print(f"[summary] run report: {write(run)} (static, opens offline in any browser)")
    if (run / "tensorboard").is_dir():
        print(f"[summary] tensorboard: {run / 'tensorboard'} (tensorboard --logdir {run / 'tensorboard'})")
    failed = checks(gaps, engine_logp, ours, args.max_gap, args.min_move)
    for line in failed:
        print(f"[summary] weight check failed: {line}", file=sys.stderr)
    if not failed:
        print(
            f"[summary] weight checks passed: gap <= {args.max_gap} at every step, SGLang's log-probs moved, deltas synced"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
