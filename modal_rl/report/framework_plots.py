"""The framework's own training curves for the report: loss, KL, entropy, throughput.

Read from the names the framework itself logs into ``metrics.jsonl`` (verl: ``actor/*``,
``perf/*``; slime's train step: ``train/*``). For each panel the first name the run logged
is drawn; a panel the run has no name for is left out.

Invariants: as :mod:`.plots` (``(title, svg)`` or None; deterministic SVG; no figure left
open); nothing here renames or rescales a value: the axis says the logged name.
"""

from __future__ import annotations

from modal_rl.report.plots import _figure, _line, _steps_axis, _svg, first_series
from modal_rl.report.run_dir import RunData

# panel label -> candidate names, verl's first, then slime's
PANELS = (
    ("policy loss", ("actor/pg_loss", "train/pg_loss", "train/loss")),
    ("KL", ("actor/kl_loss", "actor/ppo_kl", "train/kl_loss", "train/ppo_kl")),
    ("entropy", ("actor/entropy", "train/entropy_loss")),
    ("throughput (tokens/s per GPU)", ("perf/throughput",)),
)


def names_drawn(run: RunData) -> list[str]:
    """The metric names the training plot draws for ``run``, one per panel found."""
    return [found[0] for _, keys in PANELS if (found := first_series(run, keys))]


def training(run: RunData):
    panels = [(label, found) for label, keys in PANELS if (found := first_series(run, keys))]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (label, (name, series)) in zip(axes, panels, strict=True):
        _line(ax, series, name)
        ax.set_ylabel(label)
        ax.legend(loc="best")
        _steps_axis(ax, run)
    return "Training: " + ", ".join(label.split(" (")[0] for label, _ in panels), _svg(fig)


def draw(run: RunData) -> list[tuple[str, str]]:
    return [got for got in (training(run),) if got is not None]
