"""The ``modal_rl/`` step numbers and the static run report (``python -m modal_rl.report``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from modal_rl.report import numbers as n
from modal_rl.report.page import fmt, write
from modal_rl.report.run_dir import load
from tests._report_runs import make_run, sandbox_snapshot

ROOT = Path(__file__).resolve().parents[2]


def test_weight_sync_counts_anchors_deltas_receivers_and_refusals():
    anchor = n.SyncRecord(
        seconds=1.5,
        sender={
            "checkpoint_engine/version": 0.0,
            "checkpoint_engine/anchor": 1.0,
            "checkpoint_engine/payload_mbytes": 10.0,
            "checkpoint_engine/raw_mbytes": 20.0,
        },
        receivers={
            1: {
                "checkpoint_engine/payload_mbytes": 10.0,
                "checkpoint_engine/fetch_s": 0.5,
                "checkpoint_engine/refused": 2.0,
            }
        },
    )
    delta = n.SyncRecord(
        seconds=0.5,
        sender={
            "checkpoint_engine/version": 1.0,
            "checkpoint_engine/anchor": 0.0,
            "checkpoint_engine/payload_mbytes": 1.0,
            "checkpoint_engine/raw_mbytes": 20.0,
        },
        receivers={1: {"checkpoint_engine/payload_mbytes": 1.0, "checkpoint_engine/fetch_s": 0.25}},
        adapters={0: {"pause_s": 0.125}, 1: {"pause_s": 0.0625}},
    )
    got = n.weight_sync([anchor, delta])
    assert got[n.WS + "syncs"] == 2 and got[n.WS + "anchors"] == 1 and got[n.WS + "deltas"] == 1
    assert got[n.WS + "sent_mib"] == 11.0 and got[n.WS + "raw_mib"] == 40.0
    assert got[n.WS + "version"] == 1.0 and got[n.WS + "seconds"] == 2.0
    # the anchor sync has no engine-reported pause (its whole time), the delta the engines' longest
    assert got[n.WS + "engine_pause_s"] == 1.5 + 0.125
    assert got[n.WS + "refused_frames"] == 2.0
    assert got[n.WS + "receiver/1/mib"] == 11.0 and got[n.WS + "receiver/1/fetch_s"] == 0.75
    assert all(k.startswith("modal_rl/") for k in got)


def test_weight_sync_without_payload_is_a_full_copy_and_no_sync_is_zero():
    got = n.weight_sync([n.SyncRecord(seconds=0.3, full_mib=7.5)])  # verl's naive backend
    assert (got[n.WS + "anchors"], got[n.WS + "sent_mib"], got[n.WS + "engine_pause_s"]) == (1, 7.5, 0.3)
    assert n.WS + "version" not in got
    idle = n.weight_sync([])
    assert idle[n.WS + "syncs"] == 0 and idle[n.WS + "sent_mib"] == 0


def test_sandbox_numbers_are_per_step_counters_and_pool_gauges():
    before = {"a": sandbox_snapshot(4, 0, 0.5, 3, 4)}
    now = {"a": sandbox_snapshot(10, 2, 0.75, 5, 6), "b": sandbox_snapshot(1, 0, 0.0, 2, 2)}
    got = n.sandbox(before, now)
    assert got[n.SB + "samples"] == 6 + 1 and got[n.SB + "errors"] == 2 and got[n.SB + "execs"] == 14
    assert got[n.SB + "lease_wait_s"] == pytest.approx(0.25)
    assert got[n.SB + "pool_live"] == 7 and got[n.SB + "pool_target"] == 8
    assert got[n.SB + "lease_wait_p99_s"] == pytest.approx(0.25)  # the worst pool's window
    assert n.sandbox({}, {}) == {}


def test_masks_by_cause_and_engine_recovery():
    assert n.masked(["sandbox", "engine", "sandbox", "bad_tests"]) == {
        n.MASK + "samples": 4.0,
        n.MASK + "sandbox": 2.0,
        n.MASK + "bad_tests": 1.0,
        n.MASK + "internal": 0.0,
        n.MASK + "engine": 1.0,
    }
    events = [
        {"kind": "lost"},
        {"kind": "replaced"},
        {"kind": "serving", "recovery_s": 4.5},
        {"kind": "serving", "recovery_s": 9.0},
    ]
    assert n.engines(events) == {n.ENG + "replacements": 1.0, n.ENG + "lost": 1.0, n.ENG + "recovery_s": 9.0}


class _Cells(HTMLParser):
    """The report's step table: (name, step) -> the text of its cell."""

    def __init__(self):
        super().__init__()
        self.cells: dict[tuple[str, int], str] = {}
        self.values: dict[tuple[str, int], str] = {}
        self._at = None
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "td" and "data-name" in attrs:
            self._at = (attrs["data-name"], int(attrs["data-step"]))
            self.values[self._at] = attrs["data-value"]

    def handle_data(self, data):
        if self._at:
            self.cells[self._at] = self.cells.get(self._at, "") + data

    def handle_endtag(self, tag):
        if tag == "td":
            self._at = None


def test_report_numbers_equal_the_metrics_json(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path / "run", monkeypatch=monkeypatch)
    page = write(run_dir).read_text()
    parser = _Cells()
    parser.feed(page)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checked = 0
    for row in logged:
        for name, value in row["data"].items():
            if name.startswith("modal_rl/") or name in ("critic/score/mean", "response_length/mean"):
                at = (name, row["step"])
                assert float(parser.values[at]) == float(value), at  # exact
                assert parser.cells[at] == fmt(value), at  # what a person reads
                assert float(parser.cells[at]) == pytest.approx(float(value), rel=1e-5), at
                checked += 1
    assert checked >= 3 * 30  # every modal_rl/ number of every step, and the two curves
    assert re.search(r"<span id='step-count'>3</span> steps", page)


def test_report_is_self_contained_with_every_plot(tmp_path, monkeypatch):
    page = write(make_run(tmp_path / "run", monkeypatch=monkeypatch)).read_text()
    parser = _Cells()
    parser.feed(page)
    # nothing to fetch: no scripts to run, no stylesheets, images, fonts or frames by URL
    for tag, attrs in parser.tags:
        assert not (set(attrs) & {"src", "href"}) or tag == "a", (tag, attrs)
        if tag == "script":
            assert attrs.get("type") == "application/json", attrs
    assert "default-src 'none'" in page
    assert page.count("<svg") == 5, "reward/length, weight sync, sandboxes, masks, engines"
    for title in ("Weight sync", "Sandbox pool", "Masked samples", "Engine supervisor", "Reward"):
        assert title in page
    data = json.loads(re.search(r"id='run-data'>(.*?)</script>", page, re.S).group(1))
    assert data["steps"]["2"]["modal_rl/engines/replacements"] == 1.0


def test_report_of_a_run_without_sandboxes_or_engines_draws_what_it_has(tmp_path, monkeypatch):
    from verl.utils.tracking import FileLogger

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run_dir / "metrics.jsonl"))
    logger = FileLogger("p", "e")
    logger.log({"training/global_step": 1, "critic/score/mean": 0.5, **n.weight_sync([]), **n.masked([])}, 1)
    logger.log({"val-core/x": 1.0}, 1)  # a validation record at the same step: not a step
    logger.finish()
    run = load(run_dir)
    assert list(run.steps) == [1] and "val-core/x" not in run.steps[1]
    page = write(run_dir).read_text()
    assert page.count("<svg") == 3 and "Sandbox pool" not in page and "Engine supervisor" not in page
    assert "no config summary" in page.lower()


def test_shown_numbers_are_short_and_exact_ones_read_back_equal():
    from modal_rl.report.page import exact

    assert (fmt(0.1 * 6), fmt(12.0), fmt(0.30000000000000004), fmt(1234567.8)) == (
        "0.6",
        "12",
        "0.3",
        "1234570",
    )
    for value in (0.1 * 3, 1e-7, 12.0, 3, 2.5e20, 0.6000000000000001):
        assert float(exact(value)) == float(value)


def test_cli_writes_the_report_and_refuses_a_folder_without_metrics(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path / "run", monkeypatch=monkeypatch)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        [sys.executable, "-m", "modal_rl.report", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str((run_dir / "report.html").resolve())
    bad = subprocess.run(
        [sys.executable, "-m", "modal_rl.report", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert (
        bad.stderr.count("\n") == 1 and "has no metrics.jsonl" in bad.stderr and "Traceback" not in bad.stderr
    )
