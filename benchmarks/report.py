"""Shared output helpers for benchmark suites: JSON, a markdown table, progress bars."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    import os

    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(out: Path, suite: str, payload: dict[str, Any]) -> Path:
    path = out / f"{suite}.json"
    path.write_text(json.dumps({"suite": suite, "machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def progress(iterable: Iterable, total: int | None = None, desc: str = ""):
    """A tqdm bar on stderr when it is a terminal, count lines there otherwise
    (``modal_rl.progress.bar``); stdout keeps the results only."""
    from modal_rl.progress import bar

    return bar(iterable, total=total, desc=desc)
