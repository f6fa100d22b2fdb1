"""Our fixes for upstream frameworks as ``git format-patch`` series, and the check that proves them.

``patches/<framework>/series.toml`` lists a series (format: :mod:`patches.series`); ``python -m
patches check`` applies each series to a clean copy of its base and proves every fix (see
:mod:`patches.check`, ``patches/README.md``). Nothing here is imported by the product at run
time; the adapters detect the fixes in the installed framework instead (``verl_modal.upstream``).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def series_path(framework: str) -> Path:
    """``patches/<framework>/series.toml``."""
    return ROOT / framework / "series.toml"
