"""The ``engine-sync`` suite's pure parts: its model and Adam trajectory (names match the
checkpoint vLLM loads, every version distinct), the summary math and the output guard.
No vLLM server here (``test_vllm_engine_push.py`` covers the real one)."""

from __future__ import annotations

import pytest
import torch

from benchmarks._engine_sync_model import adam_versions, changed_fraction, make_model_dir
from benchmarks.engine_sync import METRICS, PEERS, check_outputs, render, render_summary, summarize


@pytest.mark.slow
def test_trajectory_versions_are_distinct_bf16_states_with_the_checkpoint_names(tmp_path):
    from safetensors.torch import load_file

    model_dir = make_model_dir(tmp_path)
    assert make_model_dir(tmp_path) == model_dir  # made once
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    states = adam_versions(model_dir, 2)
    assert len(states) == 2
    for state in states:
        # Tied embeddings: the checkpoint may also store lm_head; the engine loads these names.
        assert set(state) <= set(checkpoint) and set(checkpoint) - set(state) <= {"lm_head.weight"}
        assert all(t.dtype == torch.bfloat16 and t.shape == checkpoint[k].shape for k, t in state.items())
    start = {k: checkpoint[k] for k in states[0]}
    steps = [changed_fraction(start, states[0]), changed_fraction(states[0], states[1])]
    # A real lr-1e-6 Adam step moves a small, nonzero share of bf16 words.
    assert all(0.0 < f < 0.2 for f in steps), steps
    again = adam_versions(model_dir, 1)[0]  # same seed, same first step
    assert again.keys() == states[0].keys() and all(torch.equal(again[k], states[0][k]) for k in again)


def _rows(n: int, scale: float, anchor_every: int) -> list[dict[str, float]]:
    rows = []
    for v in range(n):
        anchor = v % anchor_every == 0
        value = 100.0 if anchor else scale * (v + 1)
        rows.append({"version": float(v), **{m: value for m in METRICS}})
    return rows


def test_summary_leaves_out_version_0_and_ratios_are_full_over_delta():
    per_mode = {"full": _rows(5, 1.0, 1), "delta": _rows(5, 1.0, 16)}
    out = summarize(per_mode)
    # full: versions 1..4 are anchors (100); delta: 2, 3, 4, 5 -> median 3.5, mean 3.5.
    assert out["medians"]["full"]["payload_mbytes"] == 100.0
    assert out["medians"]["delta"]["engine_s"] == 3.5
    assert out["ratios"]["encode_s"] == pytest.approx(100.0 / 3.5)
    delta_18 = summarize({"full": _rows(18, 1.0, 1), "delta": _rows(18, 1.0, 16)})
    # The re-anchor at version 16 moves the delta mode's mean, not its median.
    assert delta_18["means"]["delta"]["payload_mbytes"] > delta_18["medians"]["delta"]["payload_mbytes"]
    with pytest.raises(ValueError, match="no version after 0"):
        summarize({"full": _rows(1, 1.0, 1), "delta": _rows(1, 1.0, 16)})
    three = summarize({"full": _rows(5, 1.0, 1), "delta": _rows(5, 1.0, 16), "inplace": _rows(5, 0.5, 16)})
    assert three["inplace_ratios"]["pause_s"] == pytest.approx(100.0 / 1.75)  # full / in place


def test_output_guard_needs_equal_finals_that_differ_from_before():
    before = {"tokens": [1, 2], "logprobs": [-1.0, -2.0]}
    after = {"tokens": [1, 2], "logprobs": [-1.0, -2.5]}
    verdict = check_outputs(before, {"full": after, "delta": dict(after)})
    assert verdict == {"tokens_changed": False, "max_logprob_change": 0.5}
    with pytest.raises(RuntimeError, match="answered differently"):
        check_outputs(before, {"full": after, "delta": before})
    with pytest.raises(RuntimeError, match="did not change"):
        check_outputs(before, {"full": before, "delta": before})


def test_render_shows_medians_means_and_a_failed_guard():
    per_mode = {"full": _rows(5, 1.0, 1), "delta": _rows(5, 1.0, 16)}
    payload = {
        "params_m": 22.3,
        "versions": 5,
        "lr": 1e-6,
        "changed_fraction_median": 0.014,
        "engine": "one engine",
        **summarize(per_mode),
        "greedy": {"failed": "boom", "prefix_cache_stale": True},
    }
    text = render(payload)
    assert "| wire MB | 100 | 3.5 | 100 | 3.5 |" in text
    assert "FAILED: boom" in text and "1.40% of words" in text


def test_the_summary_table_marks_published_peer_numbers_as_other_hardware():
    case = {
        "full_pause_s": 0.8,
        "reload_delta_pause_s": 0.4,
        "delta_pause_s": 0.02,
        "full_pause_wall_s": 0.9,
        "delta_pause_wall_s": 0.05,
    }
    summary = {
        **case,
        "inplace": True,
        "params_identical": True,
        "completions_identical": True,
        "fallback_params": 0,
        "pause_ratio": 0.025,
        "many_small": case,
    }
    text = render_summary({"summary": summary, "peers_published": PEERS})
    assert "| this run: qwen2-22m, vllm-cpu | delta, in place | 0.02 |" in text
    assert "| published: stitch (SGLang, in place), 8B, 1x H100 | delta, in place | 0.32-0.42 |" in text
    assert "in-place pause / full pause = 0.025" in text
