"""``python -m benchmarks chaos [--quick] [--out DIR]``: kill parts of a run, measure what is lost.

Scenarios (real processes; each against an undisturbed run of the same inputs):

- (a) SIGKILL the ``modal_vllm`` engine during a verl ``separate_async`` CPU run,
- (b) SIGKILL a weight receiver in the middle of an anchor (``chaos_receiver.py``),
- (c) SIGKILL the trainer driver after step 2 and restart the same command (``chaos_trainer.py``),
- (d) SIGKILL a local cluster follower with ``--retries 1`` (``chaos_cluster.py``),
- (e) SIGKILL sandboxes while they score samples (``chaos_sandboxes.py``).

Every mode runs all five. ``--quick`` runs (a) and (c) in short forms (3 and 2 verl steps, no
undisturbed reference run, so their final weights are not compared: null); full mode runs the
long forms with their references. ``--only NAME`` runs one. A scenario that is not run is
listed as such, never reported with made-up fields.
Output: ``DIR/chaos.json`` (``scenarios[]`` with the fields of ``FIELDS``, null where a field
does not apply, plus per-scenario ``details``), ``DIR/chaos.md`` (a table) and
``DIR/chaos.png``. One progress line per phase on stderr.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

from benchmarks.report import markdown_table, write_json

FIELDS = (
    "name",
    "completed",
    "steps_lost",
    "steps_since_checkpoint",
    "wrong_version_samples",
    "recovery_s",
    "engine_cold_start_s",
    "anchor_transfer_s",
    "leaked_processes",
    "leaked_sandboxes",
    "final_weights_match",
)
NOT_BUILT: dict[str, str] = {}


def _say(line: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _scenarios():
    from benchmarks import chaos_cluster, chaos_engine, chaos_receiver, chaos_sandboxes, chaos_trainer

    return [  # (name, run_scenario)
        ("a_engine_kill", chaos_engine.run_scenario),
        ("b_receiver_kill_mid_anchor", chaos_receiver.run_scenario),
        ("c_trainer_restart", chaos_trainer.run_scenario),
        ("d_cluster_follower_kill", chaos_cluster.run_scenario),
        ("e_sandbox_kill", chaos_sandboxes.run_scenario),
    ]


def _failed(name: str, exc: BaseException) -> dict:
    return {
        **dict.fromkeys(FIELDS),
        "name": name,
        "completed": False,
        "details": {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]},
    }


def done_when(scenario: dict) -> bool:
    """The issue's bar: completed, no wrong-version sample, nothing leaked, steps lost bounded by
    the steps since the last checkpoint (0 where there is no checkpoint in play), and an
    engine's recovery within the same run's engine cold start + its catch-up + 10 s."""
    s = scenario
    lost = s["steps_lost"]
    bound = s["steps_since_checkpoint"] if s["steps_since_checkpoint"] is not None else 0
    recovery, cold = s["recovery_s"], s["engine_cold_start_s"]
    if cold is not None and (recovery is None or recovery > cold + (s["anchor_transfer_s"] or 0) + 10):
        return False
    return bool(
        s["completed"]
        and (s["wrong_version_samples"] in (None, 0))
        and (s["leaked_processes"] in (None, 0))
        and (s["leaked_sandboxes"] in (None, 0))
        and (lost is None or lost <= bound)
        and s["final_weights_match"] is not False
    )


def run(quick: bool, out: Path, only: str | None = None) -> dict:
    """All scenarios, or with ``only`` that one alone."""
    results, not_run = [], dict(NOT_BUILT)
    scenarios = _scenarios()
    if only is not None:
        if only not in [name for name, _ in scenarios]:
            raise SystemExit(
                f"chaos: no scenario {only!r}; choose one of {', '.join(n for n, _ in scenarios)}"
            )
        scenarios = [s for s in scenarios if s[0] == only]
    suite_t0 = time.monotonic()
    for k, (name, scenario) in enumerate(scenarios, 1):
        _say(
            f"scenario {k}/{len(scenarios)} {name}: start ({time.monotonic() - suite_t0:.0f} s into the suite)"
        )
        t0 = time.monotonic()
        try:
            result = scenario(quick, say=_say)
        except Exception as exc:  # a scenario that breaks is reported, and the others still run
            result = _failed(name, exc)
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["meets_done_when"] = done_when(result)
        _say(f"scenario {name}: done in {result['wall_s']} s, completed={result['completed']}")
        results.append(result)
    for name, why in not_run.items():
        _say(f"scenario {name}: not run ({why})")
    payload = {
        "quick": quick,
        "scenarios": results,
        "not_run": [{"name": n, "why": w} for n, w in not_run.items()],
    }
    write_json(out, "chaos", payload)
    table = markdown_table(
        [*FIELDS, "wall_s"], [[_cell(s.get(f)) for f in (*FIELDS, "wall_s")] for s in results]
    )
    not_run_md = "\n".join(f"- {n}: not run - {w}" for n, w in not_run.items())
    plots = _plot(out, results)
    md = f"# chaos ({'quick' if quick else 'full'})\n\n{table}\n\n{not_run_md}\n"
    md += "".join(f"\n![{p}]({p})\n" for p in plots)
    (out / "chaos.md").write_text(md)
    print(table)
    return payload


def _cell(value):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value


def _plot(out: Path, results: list[dict]) -> list[str]:
    """Per scenario: time from the kill to recovery, next to the undisturbed wall time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    shown = [r for r in results if r.get("recovery_s") is not None]
    if not shown:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    names = [r["name"] for r in shown]
    ax.barh(names, [r["recovery_s"] for r in shown], color="C3", label="kill -> recovered")
    for i, r in enumerate(shown):
        lost = r["steps_lost"]
        ax.text(r["recovery_s"], i, f"  {r['recovery_s']:.1f} s, steps lost {lost}", va="center")
    ax.set_xlabel("seconds")
    ax.set_xlim(0, max(r["recovery_s"] for r in shown) * 1.6)
    ax.set_title("chaos: recovery time per scenario (this machine)")
    fig.tight_layout()
    fig.savefig(out / "chaos.png", dpi=110)
    plt.close(fig)
    return ["chaos.png"]
