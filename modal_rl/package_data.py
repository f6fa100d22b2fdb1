"""Where the files that travel with the package are: the patch series a launcher applies.

A wheel carries each series as ``modal_rl/patch_series/<framework>/`` (copied at build time
by setup.py); a checkout has them under ``patches/<framework>/`` at the repository root. The
packaged copy wins when present, else the checkout's; the missing-series error names both.
"""

from __future__ import annotations

from pathlib import Path

PACKAGED = Path(__file__).resolve().parent / "patch_series"
CHECKOUT = Path(__file__).resolve().parents[1] / "patches"


def series_dir(framework: str) -> Path:
    """The directory holding ``framework``'s ``series.toml`` and patch files (it may not exist:
    callers report ``<dir>/series.toml`` missing)."""
    packaged = PACKAGED / framework
    if (packaged / "series.toml").is_file():
        return packaged
    return CHECKOUT / framework
