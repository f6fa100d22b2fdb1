"""CI for the verl half of ``patches/``: ``python -m patches check --verl sdist`` on the verl
0.9.1 source distribution from the package index (cached after the first download).

Proves, on a clean copy of the sdist: every patch of ``patches/verl/series.toml`` applies in
order, each fix's new ``_on_cpu`` test fails before its patch and passes after, and the
listed upstream CPU tests pass on the patched tree. 10 pytest processes, start-up imports
dominate; they run two at a time on a 2-core box (``patches/stages.py``, ``MODAL_RL_PATCHES_JOBS``);
``MODAL_RL_PATCHES_CACHE`` moves the download cache.
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

ROOT = Path(__file__).resolve().parents[2]


def test_verl_series_file_is_consistent():
    series = load(series_path("verl"))
    assert [p.label for p in series.patches] == [f"{i:04d}" for i in range(1, 10)]
    assert all(p.fix for p in series.patches)
    # CPU unit tests, or repository scans with verl's sanity checks (sanity.yml runs those)
    assert all(
        t.endswith("_on_cpu.py") or t.startswith("tests/special_sanity/")
        for p in series.patches
        for t in p.new_tests
    )
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
    patches = [r for r in rows if r["patch"] not in ("series", "sanity")]
    assert [r["patch"][:4] for r in patches] == [
        "0001",
        "0002",
        "0003",
        "0004",
        "0005",
        "0006",
        "0007",
        "0008",
        "0009",
    ]
    for row in patches:
        assert row["applies"] and row["ok"], row
        assert row["before"].startswith("FAIL") and row["after"].startswith("pass"), row
    (final,) = [r for r in rows if r["patch"] == "series"]
    assert final["ok"] and final["after"].startswith("pass"), final
    (sanity,) = [r for r in rows if r["patch"] == "sanity"]  # ruff, with verl's settings
    assert sanity["ok"], sanity
    print(proc.stdout)  # the summary table, for the CI log


VERL_MIRROR = Path("/work/.mirror/verl-project+verl/repo")  # a bare clone from the fetch tool
# The headers verl's tests/special_sanity/check_license.py accepts that a contributor outside
# the listed companies can use.
INDIVIDUAL_HEADER = "# Copyright 2025 Individual Contributor: "


@pytest.mark.parametrize("framework", ["verl", "verl-main", "slime"])
def test_patches_carry_an_honest_author_and_no_unfinished_text(framework):
    series = load(series_path(framework))
    for patch in series.patches:
        text = patch.file.read_text()
        assert "\nFrom: modal-rl maintainers <modal-rl@users.noreply.github.com>\n" in text, patch.file.name
        assert "\nCo-authored-by: Claude" in text.split("\n---\n", 1)[0], patch.file.name
        for word in ("TODO", "placeholder", "Seed "):
            assert word not in text, f"{patch.file.name} holds {word!r}"
    docs = (ROOT / "docs" / "upstream.md").read_text()
    assert "TODO" not in docs and "placeholder" not in docs.lower()


@pytest.mark.parametrize("framework", ["verl", "verl-main"])
def test_verl_new_tests_have_a_license_header_and_live_under_a_module(framework):
    series = load(series_path(framework))
    for patch in series.patches:
        text = patch.file.read_text()
        for test in patch.new_tests:
            parts = test.split("/")
            assert len(parts) >= 3 and parts[0] == "tests", (
                f"{test}: tests/<module>/... (validate_structure.py)"
            )
            added = text.split(f"+++ b/{test}\n", 1)[1]
            assert added.split("\n", 2)[1].startswith("+" + INDIVIDUAL_HEADER), test


def test_verl_main_series_is_the_form_to_send():
    series = load(series_path("verl-main"))
    assert series.base.commit.startswith("1dda039b9")
    assert [p.label for p in series.patches] == [f"{i:04d}" for i in range(1, 8)]
    assert all(p.fix for p in series.patches)
    sanity = " ".join(series.base.sanity)
    for script in (
        "check_license.py",
        "validate_structure.py",
        "check_docstrings.py",
        "check_device_api_usage.py",
    ):
        assert script in sanity
    # the late-GPU wait is not proposed upstream (docs/upstream.md says why)
    assert not any("register late" in p.title for p in series.patches)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not VERL_MIRROR.is_dir(), reason="needs a verl clone holding the verl-main base commit")
def test_verl_main_series_passes_the_check_and_verls_own_sanity(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "patches",
            "check",
            "--framework",
            f"verl-main={VERL_MIRROR}",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "SLIME_PATH"},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = {r["patch"]: r for r in json.loads(out.read_text())}
    assert rows["sanity"]["ok"] and rows["sanity"]["after"] == "pass 6/6", rows["sanity"]
    assert rows["series"]["ok"], rows["series"]
