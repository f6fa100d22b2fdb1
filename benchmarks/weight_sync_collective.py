"""Suite ``weight-sync-collective``: the same frames over TCP and over a torch.distributed group.

One trainer rank process publishes a tiled real trajectory (``weight-sync-scale``'s data:
the bf16 sync points of an Adam run, tiled to ``state_gb``) to two receiver processes, once
through its frame server over TCP and once through ``transport.collective`` over a gloo
group on 127.0.0.1 (what NCCL does inside a GPU cluster, gloo does here), neither
rate-limited: an anchor, then ``versions`` deltas. Per version: seconds from ``publish`` to
the last receiver's activation, bytes, and whether every receiver ended bit-identical; the
ratio collective / TCP of the steady delta. Both runs use ``weight-sync-scale``'s processes
(``benchmarks/_scale_procs.py``), so nothing but the transport differs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from benchmarks._weight_sync_data import tiled_size
from benchmarks.report import markdown_table, progress, write_json
from benchmarks.weight_sync_scale import run_scenario, write_trajectory

SUITE = "weight-sync-collective"
RECEIVERS = 2


def run(quick: bool, out: Path) -> dict[str, Any]:
    import os

    import torch

    from modal_rl.run_key import RUN_KEY_ENV, new_run_key

    versions = 3 if quick else 6
    target_gb = 0.5 if quick else 2.0
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    rows = []
    with tempfile.TemporaryDirectory(prefix="mrl-collective-", dir=out) as workdir:
        traj = Path(workdir)
        small_gb = write_trajectory(traj, versions)
        tiles = tiled_size(torch.load(traj / "v0.pt"), target_gb)
        for transport in progress(["tcp", "gloo"], total=2, desc=SUITE):
            (row,) = run_scenario(traj, tiles * small_gb, tiles, 1, RECEIVERS, [None], versions, transport)
            rows.append({"transport": transport, **row})
    tcp, gloo = (next(r for r in rows if r["transport"] == t) for t in ("tcp", "gloo"))
    payload = {
        "quick": quick,
        "versions": versions,
        "receivers": RECEIVERS,
        "rows": rows,
        "steady_ratio_gloo_vs_tcp": gloo["steady_delta_s"] / tcp["steady_delta_s"],
        "anchor_ratio_gloo_vs_tcp": gloo["anchor_s"] / tcp["anchor_s"],
    }
    write_json(out, SUITE, payload)
    text = render(payload)
    (out / f"{SUITE}.md").write_text(text)
    plot(rows, out / f"{SUITE}.png")
    print(text)
    return payload


def render(payload: dict[str, Any]) -> str:
    table = markdown_table(
        [
            "transport",
            "state GB",
            "receivers",
            "anchor s",
            "first delta s",
            "steady delta s",
            "bytes anchor",
            "bytes delta",
            "decode s",
            "receiver CPU s",
            "bit-exact",
        ],
        [
            [
                r["transport"],
                f"{r['state_gb']:.3g}",
                r["receivers"],
                r["anchor_s"],
                r["first_delta_s"],
                r["steady_delta_s"],
                f"{r['bytes_anchor']:,}",
                f"{r['bytes_delta']:,.0f}",
                r["stages"]["decode_s"],
                r["cpu"]["receiver_cpu_s"],
                r["bit_exact"],
            ]
            for r in payload["rows"]
        ],
    )
    return (
        f"# {SUITE}\n\nOne rank, {payload['receivers']} receivers, no rate limit; seconds from `publish` "
        f"to the last receiver's activation.\n\n{table}\n\nCollective (gloo) / TCP: steady delta "
        f"{payload['steady_ratio_gloo_vs_tcp']:.2f}x, anchor {payload['anchor_ratio_gloo_vs_tcp']:.2f}x.\n"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(rows):
        times = r["delta_per_version_s"]
        ax.plot(range(1, len(times) + 1), times, marker="o", label=f"{r['transport']} deltas")
        ax.axhline(r["anchor_s"], color=f"C{i}", linestyle=":", label=f"{r['transport']} anchor")
    ax.set_xlabel("version")
    ax.set_ylabel("seconds, publish to last activation")
    ax.set_title(f"Same frames, two transports ({rows[0]['state_gb']:.2g} GB, {RECEIVERS} receivers)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
