"""Suite ``cluster``: local bring-up through our bootstrap vs. bare ``ray start`` commands.

For each size (2 and 4 nodes) and repetition, interleaved so load drifts hit both alike:

- ``ours``: ``LocalBackend`` starts every rank's ``python -m modal_rl.cluster.node`` at once;
  bring-up ends when rank 0 reports all nodes (with their GPUs) registered, and "first
  output" when the job's first line reaches us through the Ray Job API log tail;
- ``bare``: ``ray start --head``, then the workers' ``ray start`` in parallel, then polling
  until all nodes are alive; first output via a Job API submission afterwards.

All times are from the first process launch. Reported: the minimum over repetitions
(load from other jobs only adds time) and ``ours_s / bare_s``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._cluster_bare import bare_bringup, bare_first_output
from benchmarks.report import markdown_table, progress, write_json
from modal_rl.cluster import procs
from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backend_local import LocalBackend
from modal_rl.cluster.spec import ClusterSpec

SUITE = "cluster"
MARKER = "MODAL_RL_FIRST_OUTPUT"


def _ours(nodes: int) -> tuple[float, float]:
    marks: dict[str, float] = {}

    def on_err(line: str) -> None:
        if "nodes joined in" in line:
            marks.setdefault("joined", time.monotonic())

    def on_line(line: str) -> None:
        if MARKER in line:
            marks.setdefault("first", time.monotonic())

    backend = LocalBackend(on_line=on_line, on_err=on_err)
    spec = ClusterSpec(nodes=nodes, join_timeout_s=300)
    job = JobRequest([sys.executable, "-c", f"print('{MARKER}', flush=True)"])
    started = time.monotonic()
    code = backend.run(spec, job)
    if code != 0 or "joined" not in marks or "first" not in marks:
        raise RuntimeError(f"our bring-up of {nodes} nodes failed (exit {code})")
    return marks["joined"] - started, marks["first"] - started


def _bare(nodes: int) -> tuple[float, float]:
    backend = LocalBackend()
    plan = backend.make_plan(ClusterSpec(nodes=nodes), JobRequest(["true"]))
    try:
        started = time.monotonic()
        bringup = bare_bringup(plan)
        first = bare_first_output(plan, started, MARKER)
        return bringup, first
    finally:
        procs.end_run(plan.run_id)


def run(quick: bool, out: Path) -> dict[str, Any]:
    sizes = [2, 4]
    reps = 2 if quick else 4
    samples: dict[int, dict[str, list[float]]] = {
        n: {k: [] for k in ("ours", "bare", "ours_first", "bare_first")} for n in sizes
    }
    # ABBA order per size, so a load drift during the run hits both sides alike.
    steps = [
        (n, r, kind)
        for r in range(reps)
        for n in sizes
        for kind in (("bare", "ours"), ("ours", "bare"))[r % 2]
    ]
    for nodes, _, kind in progress(steps, total=len(steps), desc="cluster bring-ups"):
        bringup, first = (_ours if kind == "ours" else _bare)(nodes)
        samples[nodes][kind].append(bringup)
        samples[nodes][f"{kind}_first"].append(first)
    sizes_out = {}
    for n in sizes:
        # Minimum over repetitions: other jobs on the machine only ever add time.
        s = {k: min(v) for k, v in samples[n].items()}
        sizes_out[str(n)] = {
            "ours_s": round(s["ours"], 3),
            "bare_s": round(s["bare"], 3),
            "ratio": round(s["ours"] / s["bare"], 3),
            "ours_first_output_s": round(s["ours_first"], 3),
            "bare_first_output_s": round(s["bare_first"], 3),
            "samples": {k: [round(x, 3) for x in v] for k, v in samples[n].items()},
        }
    payload = {"quick": quick, "repetitions": reps, "sizes": sizes_out}
    write_json(out, SUITE, payload)
    rows = [
        [n, v["ours_s"], v["bare_s"], v["ratio"], v["ours_first_output_s"], v["bare_first_output_s"]]
        for n, v in sizes_out.items()
    ]
    table = markdown_table(
        ["nodes", "ours_s", "bare_s", "ours/bare", "ours first output s", "bare first output s"], rows
    )
    (out / f"{SUITE}.md").write_text(
        f"# cluster bring-up (local, {'quick' if quick else 'full'}, best of {reps})\n\n{table}\n"
    )
    _plot(sizes_out, out / f"{SUITE}.png")
    print(table)
    return payload


def _plot(sizes_out: dict[str, dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = list(sizes_out)
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [sizes_out[n]["bare_s"] for n in labels], 0.4, label="bare ray start")
    ax.bar([x + 0.2 for x in xs], [sizes_out[n]["ours_s"] for n in labels], 0.4, label="modal_rl bootstrap")
    ax.set_xticks(list(xs), [f"{n} nodes" for n in labels])
    ax.set_ylabel("bring-up (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
