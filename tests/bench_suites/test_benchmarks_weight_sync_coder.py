"""The ``weight-sync-coder`` suite's anchor rows: which anchors count as steady, the fit that
splits a receiver's peak into a proportional and a fixed part, and the rendered lines."""

from __future__ import annotations

import pytest

from benchmarks.weight_sync_coder import anchor_row, fit, render

MB = 1_000_000


def child(held_mb: float, peaks_mb: list[float], mode: str = "inplace") -> dict:
    """A child's report: anchors at versions 0, 4, 8 (peaks as given), deltas between."""
    frames = []
    for v in range(9):
        anchor = v % 4 == 0
        peak = peaks_mb[v // 4] if anchor else held_mb + 200
        frames.append(
            {
                "version": v,
                "kind": "anchor" if anchor else "delta",
                "peak_bytes": int(peak * MB),
                "extra_bytes": int((peak - held_mb - 200) * MB) if v else int(peak * MB),
                "undo_bytes": int(3 * MB) if anchor and v else 0,
            }
        )
    return {"mode": mode, "held_bytes": int(held_mb * MB), "fixed_bytes": 200 * MB, "frames": frames}


def test_a_row_counts_only_the_anchors_after_the_first_and_keeps_the_worst():
    row = anchor_row(child(100, [900, 350, 340]), tiles=2)  # the first builds from nothing
    assert row["peak_rss_receiver_gb"] == pytest.approx(0.350)
    assert row["anchor_extra_gb"] == pytest.approx(0.050)
    assert row["held_gb"] == pytest.approx(0.1) and row["receiver_fixed_gb"] == pytest.approx(0.2)
    assert row["anchor_every"] == 4 and row["undo_log_gb"] == pytest.approx(0.003)


def test_the_fit_recovers_a_proportional_and_a_fixed_part():
    # peak = 1.05 x held + 300 MB exactly, at three sizes
    rows = [anchor_row(child(h, [900, 1.05 * h + 300, 1.05 * h + 290]), tiles=1) for h in (50, 200, 400)]
    f = fit(rows)
    assert f["proportional"] == pytest.approx(1.05) and f["fixed_gb"] == pytest.approx(0.3)
    assert f["extra_proportional"] == pytest.approx(0.05) and f["extra_fixed_gb"] == pytest.approx(0.1)
    noisy = rows[:2] + [anchor_row(child(400, [900, 1.05 * 400 + 340, 0]), tiles=8)]
    assert fit(noisy)["fixed_gb_worst_row"] >= fit(noisy)["fixed_gb"]


def test_the_rendered_lines_name_every_row_and_fit():
    rows = [
        anchor_row(child(h, [900, h + 300, h + 300], mode), 1)
        for mode in ("fresh", "inplace")
        for h in (50, 400)
    ]
    fits = {mode: fit([r for r in rows if r["mode"] == mode]) for mode in ("fresh", "inplace")}
    result = {
        "coder": {"words": 1, "changed": 1, "ns_per_changed_numpy": 2, "ns_per_changed_compiled": 1},
        "anchors": {"anchor_every": 4, "rows": rows, "fit": fits},
        "threads": {
            "words": 1,
            "per_threads": {1: {"encode_s": 1, "decode_s": 1}, 2: {"encode_s": 1, "decode_s": 1}},
        },
        "load": ["1", "1", "1"],
        "load_after": ["1", "1", "1"],
    }
    result["coder"] |= {"speedup": 2.0, "identical": True}
    result["coder"] |= {
        "ns_per_changed_previous": 1.5,
        "speedup_over_previous": 1.5,
        "bytes_previous": 100,
        "bytes": 99,
        "decode_ns_per_changed_previous": 2.0,
        "decode_ns_per_changed": 1.5,
    }
    text = render(result)
    assert (
        text.count("anchors every 4 (") == 4 and "anchors (inplace) fit: peak = 1.000 x held + 300 MB" in text
    )
    assert "previous (Huffman planes) -> now (rANS planes): 1.5 -> 1.0" in text
