"""The run report as a person sees it: headless Chromium opens ``report.html`` from disk (no
network), and the screenshot and the rendered DOM show every plot, the step count and the
run's numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

from modal_rl.report.page import exact, fmt, write
from tests import _chromium
from tests._report_runs import make_run

BLUE, RED, ORANGE = (31, 119, 180), (214, 39, 40), (255, 127, 14)  # matplotlib's C0, C3, C1


def check_rendered(report: Path, tmp: Path, steps: int, plots: int) -> str:
    """Screenshot and DOM checks shared with the real-run test; returns the DOM."""
    shot = _chromium.screenshot(report, tmp / "report.png")
    assert _chromium.ink_fraction(shot) > 0.01, "the page rendered (nearly) blank"
    # Colour on the page comes from the plots alone (text and tables are black and grey).
    assert _chromium.colored_fraction(shot) > 0.002, "the plots drew (almost) nothing in colour"
    assert _chromium.color_fraction(shot, BLUE) > 0.0001, "no plotted line or bar in matplotlib's blue"
    dom = _chromium.dom(report)
    svgs = re.findall(r"<svg\b.*?</svg>", dom, re.S)
    assert len(svgs) == plots, len(svgs)
    for svg in svgs:
        assert len(re.findall(r"<path\b", svg)) >= 10, "an SVG with (almost) nothing drawn in it"
    assert re.search(rf"<span id=\"step-count\">{steps}</span> steps", dom), dom[:2000]
    return dom


def test_chromium_renders_every_plot_and_the_runs_numbers(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path / "run", monkeypatch=monkeypatch)
    report = write(run_dir)
    dom = check_rendered(report, tmp_path, steps=3, plots=5)
    shot = tmp_path / "report.png"
    assert _chromium.color_fraction(shot, RED) > 0.0002  # the anchor's bar
    assert _chromium.color_fraction(shot, ORANGE) > 0.0002  # masked samples, sandbox cause
    row = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1]
    for name in ("modal_rl/weight_sync/sent_mib", "modal_rl/sandbox/lease_wait_p99_s", "critic/score/mean"):
        value = row["data"][name]
        cell = f'<td data-name="{name}" data-step="2" data-value="{exact(value)}">{fmt(value)}</td>'
        assert cell in dom, (name, value)


def test_the_check_fails_a_page_whose_plots_did_not_draw(tmp_path, monkeypatch):
    import pytest

    report = write(make_run(tmp_path / "run", monkeypatch=monkeypatch))
    page = report.read_text()
    # the same page, each plot an empty SVG of its size: what a broken renderer would leave
    report.write_text(re.sub(r"(<svg\b[^>]*>).*?</svg>", r"\1</svg>", page, flags=re.S))
    with pytest.raises(AssertionError, match="colour|blue|nothing drawn"):
        check_rendered(report, tmp_path, steps=3, plots=5)
