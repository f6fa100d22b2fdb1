"""A few of the run's generations for the report: prompt, response and reward.

They come from verl's own rollout dump (``trainer.rollout_data_dir``, which the local and
cluster launchers point at ``<run>/generations``): one ``<step>.jsonl`` per training step,
one ``{"input", "output", "score", "step", ...}`` per sample. The report shows the last
dumped step's first :data:`SHOWN` samples.

Invariants: the text is model-written, so it is treated as hostile: every string passes
``modal_rl.text_safety.clean`` (no terminal control or bidi character survives) and is cut
to :data:`MAX_CHARS` before the page escapes it as HTML; a malformed line or a non-numeric
score is skipped, never raised.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SHOWN = 4
MAX_CHARS = 1500


@dataclass(frozen=True)
class ShownSample:
    step: int
    prompt: str
    response: str
    reward: float | None


def _cut(text: object) -> str:
    from modal_rl.text_safety import clean

    out = clean(text if text is not None else "", multiline=True)
    return (
        out if len(out) <= MAX_CHARS else out[:MAX_CHARS] + f" ... ({len(out) - MAX_CHARS} more characters)"
    )


def _reward(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def dumped_steps(folder: Path) -> list[int]:
    """The steps that have a ``<step>.jsonl`` in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(p.stem) for p in folder.glob("*.jsonl") if p.stem.isdigit())


def read(folder: Path, shown: int = SHOWN) -> list[ShownSample]:
    """The last dumped step's first ``shown`` samples; empty when there is no dump."""
    steps = dumped_steps(Path(folder))
    if not steps:
        return []
    step = steps[-1]
    out: list[ShownSample] = []
    for line in (Path(folder) / f"{step}.jsonl").read_text(errors="replace").splitlines():
        if len(out) >= shown:
            break
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or "output" not in row:
            continue
        out.append(
            ShownSample(step, _cut(row.get("input")), _cut(row.get("output")), _reward(row.get("score")))
        )
    return out
