"""The report's plots: matplotlib figures rendered to inline SVG.

Why matplotlib: it is already the project's plotting library (the benchmark suites draw
docs/img/*.png with it, ``modal-rl[bench]``), it renders on a machine with no display
(``Agg``), and its SVG output is one self-contained element (text kept as text, no fonts or
scripts to fetch), so the page needs no network when it is opened. A JavaScript charting
library would have to be inlined (hundreds of KB) and would draw only with scripts enabled.

Invariants: every function returns ``(title, svg)`` or None when the run has nothing to
draw for it; the SVG is deterministic for the same numbers (``svg.hashsalt``); no figure
stays open.
"""

from __future__ import annotations

import io

from modal_rl.report import numbers as n
from modal_rl.report.run_dir import RunData

# Per-step reward and response length: verl's names, then slime's.
REWARD_KEYS = ("critic/score/mean", "rollout/raw_reward", "rollout/rewards")
LENGTH_KEYS = ("response_length/mean", "rollout/response_lengths", "rollout/response_len/mean")
COLORS = {
    "anchor": "#d62728",
    "delta": "#1f77b4",
    "sandbox": "#ff7f0e",
    "bad_tests": "#8c564b",
    "internal": "#7f7f7f",
    "engine": "#9467bd",
}


def available() -> str | None:
    """None when matplotlib can draw here, else why not (one line)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'modal-rl[bench]'); numbers only"
    return None


def _figure(rows: int = 1):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "modal-rl-report", "font.size": 9})
    fig, axes = plt.subplots(rows, 1, figsize=(7.5, 2.6 * rows), squeeze=False)
    return fig, [a[0] for a in axes]


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def first_series(run: RunData, keys: tuple[str, ...]) -> tuple[str, list[tuple[int, float]]] | None:
    for key in keys:
        if series := run.series(key):
            return key, series
    return None


def _line(ax, series, label, color=None, marker="o", **style):
    xs, ys = zip(*series, strict=True)
    ax.plot(xs, ys, marker=marker, label=label, color=color, **style)


def _steps_axis(ax, run: RunData) -> None:
    steps = sorted(run.steps)
    ax.set_xticks(steps if len(steps) <= 20 else steps[:: max(1, len(steps) // 10)])
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def reward_and_length(run: RunData):
    reward, length = first_series(run, REWARD_KEYS), first_series(run, LENGTH_KEYS)
    if not reward and not length:
        return None
    fig, (ax1, ax2) = _figure(2)
    for ax, found, what in ((ax1, reward, "reward (mean)"), (ax2, length, "response length (tokens, mean)")):
        if found:
            _line(ax, found[1], found[0])
            ax.legend(loc="best")
        ax.set_ylabel(what)
        _steps_axis(ax, run)
    return "Reward and response length", _svg(fig)


def weight_sync(run: RunData):
    sent = run.series(n.WS + "sent_mib")
    if not sent:
        return None
    fig, (ax1, ax2) = _figure(2)
    anchors = dict(run.series(n.WS + "anchors"))
    xs = [s for s, _ in sent]
    colors = [COLORS["anchor"] if anchors.get(s, 0) > 0 else COLORS["delta"] for s in xs]
    ax1.bar(xs, [v for _, v in sent], color=colors)
    ax1.set_ylabel("MiB sent per step")
    ax1.set_title("red: the step's syncs include an anchor (full weights); blue: deltas only", fontsize=8)
    receivers = sorted({k.split("/")[3] for k in run.names() if k.startswith(n.WS + "receiver/")})
    for rank in receivers:
        if got := run.series(f"{n.WS}receiver/{rank}/mib"):
            _line(ax1, got, f"received by rank {rank}", marker="x")
    if receivers:
        ax1.legend(loc="best")
    _steps_axis(ax1, run)
    # Drawn so both stay visible where they are equal (verl's colocated sync pauses for all of it).
    for key, label, style in (
        ("seconds", "sync time", {"linewidth": 4, "alpha": 0.5}),
        ("engine_pause_s", "engine pause", {"linestyle": "--", "marker": "x"}),
    ):
        if got := run.series(n.WS + key):
            _line(ax2, got, label, **style)
    ax2.set_ylabel("seconds per step")
    ax2.legend(loc="best")
    _steps_axis(ax2, run)
    return "Weight sync: size, time, engine pause", _svg(fig)


def sandboxes(run: RunData):
    if not run.series(n.SB + "pool_live"):
        return None
    fig, (ax1, ax2) = _figure(2)
    for key, label in (
        ("pool_live", "live"),
        ("pool_warm", "warm"),
        ("leased", "leased"),
        ("pool_target", "adaptive target"),
    ):
        if got := run.series(n.SB + key):
            _line(ax1, got, label, marker="o" if key != "pool_target" else "s")
    ax1.set_ylabel("sandboxes")
    ax1.legend(loc="best")
    _steps_axis(ax1, run)
    for key, label in (
        ("lease_wait_p50_s", "lease wait p50"),
        ("lease_wait_p99_s", "lease wait p99"),
        ("create_p50_s", "create p50"),
        ("create_p99_s", "create p99"),
    ):
        if got := run.series(n.SB + key):
            _line(ax2, got, label)
    ax2.set_ylabel("seconds")
    ax2.legend(loc="best")
    _steps_axis(ax2, run)
    return "Sandbox pool: size against its target, lease waits, create times", _svg(fig)


def masked(run: RunData):
    if not run.series(n.MASK + "samples"):
        return None
    fig, (ax,) = _figure(1)
    bottom: dict[int, float] = {}
    for cause in n.MASK_CAUSES:
        got = run.series(n.MASK + cause)
        if not got:
            continue
        xs = [s for s, _ in got]
        ax.bar(
            xs,
            [v for _, v in got],
            bottom=[bottom.get(s, 0.0) for s in xs],
            color=COLORS[cause],
            label=cause.replace("_", " "),
        )
        for s, v in got:
            bottom[s] = bottom.get(s, 0.0) + v
    if not any(bottom.values()):
        ax.text(0.5, 0.5, "no sample was masked", transform=ax.transAxes, ha="center", va="center")
    ax.set_ylabel("samples masked")
    ax.set_ylim(bottom=0, top=max(1.0, max(bottom.values(), default=0.0) * 1.2))
    ax.legend(loc="best")
    _steps_axis(ax, run)
    return "Masked samples (left out of the loss) by cause", _svg(fig)


def engines(run: RunData):
    if not run.events and not run.series(n.ENG + "replacements"):
        return None
    fig, (ax,) = _figure(1)
    if run.events:
        t0 = min(float(e.get("t", 0)) for e in run.events)
        kinds = list(
            dict.fromkeys(str(e.get("kind")) for e in sorted(run.events, key=lambda e: float(e.get("t", 0))))
        )
        kinds.reverse()  # first kind to happen on top, as the timeline reads
        for row, kind in enumerate(kinds):
            ts = [float(e.get("t", 0)) - t0 for e in run.events if str(e.get("kind")) == kind]
            ax.scatter(ts, [row] * len(ts), label=kind, marker="|", s=200)
        ax.set_yticks(range(len(kinds)), kinds)
        ax.set_xlabel("seconds since the first engine event")
    else:
        _line(ax, run.series(n.ENG + "replacements"), "engines replaced")
        _steps_axis(ax, run)
    ax.grid(alpha=0.3)
    return "Engine supervisor: engines lost, replaced and serving again", _svg(fig)


ALL = (reward_and_length, weight_sync, sandboxes, masked, engines)


def draw(run: RunData) -> list[tuple[str, str]]:
    return [got for plot in ALL if (got := plot(run)) is not None]
