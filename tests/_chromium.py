"""Headless Chromium for the report tests: open a page as a person would, screenshot it,
and read the DOM it rendered. Debian's ``chromium`` (``scripts/install.sh`` installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome")


def find() -> str:
    """The browser's path; skips the test, saying why, when there is none."""
    for name in NAMES:
        if path := shutil.which(name):
            return path
    pytest.skip(
        "no chromium on PATH: `bash scripts/install.sh` installs it with apt-get when run as root; "
        "otherwise `apt-get install chromium`"
    )


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    # Its profile and temp files go to a short-named folder of its own, removed afterwards
    # (Chromium's singleton socket path must fit a unix socket's 108 bytes).
    with tempfile.TemporaryDirectory(prefix="mrl-chr-") as tmp:
        env = {**os.environ, "TMPDIR": tmp, "HOME": tmp}
        base = [
            find(),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={tmp}/profile",
        ]
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout, env=env)


def screenshot(page: Path, out: Path, size: tuple[int, int] = (1280, 5000)) -> Path:
    proc = _run([f"--window-size={size[0]},{size[1]}", f"--screenshot={out}", page.resolve().as_uri()])
    assert out.is_file(), f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return out


def dom(page: Path) -> str:
    """The DOM after the page loaded, as Chromium serialises it."""
    proc = _run(["--dump-dom", page.resolve().as_uri()])
    assert proc.returncode == 0 and "<html" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


def _pixels(png: Path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)


def color_fraction(png: Path, rgb: tuple[int, int, int], tol: int = 24) -> float:
    """The share of the screenshot's pixels within ``tol`` of ``rgb``."""
    import numpy as np

    px = _pixels(png)
    return float((np.abs(px - np.array(rgb, dtype=np.int16)) <= tol).all(axis=-1).mean())


def ink_fraction(png: Path) -> float:
    """The share of pixels that are not (near) white: a blank page is ~0."""
    return float((_pixels(png).min(axis=-1) < 235).mean())


def colored_fraction(png: Path, spread: int = 60) -> float:
    """The share of saturated pixels (channels apart by more than ``spread``): plot ink only,
    since the page's text, rules and tables are black and grey."""
    px = _pixels(png)
    return float(((px.max(axis=-1) - px.min(axis=-1)) > spread).mean())
