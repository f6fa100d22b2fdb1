"""Run a launcher (``python -m <module> ...``) the way a user would, offline, and time it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_module(module: str, *argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """``(completed process, wall seconds)``; Modal credentials are dropped, so nothing can
    reach a Modal server."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("MODAL_TOKEN_ID", None)
    env.pop("MODAL_TOKEN_SECRET", None)
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out, time.monotonic() - t0
