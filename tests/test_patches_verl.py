"""CI for the verl half of ``patches/``: ``python -m patches check --verl sdist`` on the verl
0.9.1 source distribution from the package index (cached after the first download).

Proves, on a clean copy of the sdist: every patch of ``patches/verl/series.toml`` applies in
order, each fix's new ``_on_cpu`` test fails before its patch and passes after, and the
listed upstream CPU tests pass on the patched tree. ~4-6 minutes on a 2-core box (the
vLLM-importing test dominates); ``MODAL_RL_PATCHES_CACHE`` moves the download cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patches import series_path
from patches.series import load

ROOT = Path(__file__).resolve().parents[1]


def test_verl_series_file_is_consistent():
    series = load(series_path("verl"))
    assert [p.label for p in series.patches] == ["0001", "0002", "0003", "0004", "0005"]
    assert all(p.fix for p in series.patches)
    assert all(t.endswith("_on_cpu.py") for p in series.patches for t in p.new_tests)
    assert series.base.sdist == "verl==0.9.1"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_verl_patch_applies_and_flips_its_test(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SLIME_PATH"}
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "patches", "check", "--verl", "sdist", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    patches = [r for r in rows if r["patch"] != "series"]
    assert [r["patch"][:4] for r in patches] == ["0001", "0002", "0003", "0004", "0005"]
    for row in patches:
        assert row["applies"] and row["ok"], row
        assert row["before"].startswith("FAIL") and row["after"].startswith("pass"), row
    (final,) = [r for r in rows if r["patch"] == "series"]
    assert final["ok"] and final["after"].startswith("pass"), final
    print(proc.stdout)  # the summary table, for the CI log
