"""``benchmarks weight-sync-scale`` end to end at a tiny size: real rank and receiver
processes, real sockets; every row has the fields the suite's JSON promises, the receiver is
bit-exact with the trajectory and each rank held only its shard."""

from __future__ import annotations

import pytest
import torch

from benchmarks.weight_sync_scale import run_scenario
from modal_rl.run_key import RUN_KEY_ENV
from tests.weightsync_helpers import TEST_KEY, perturb

pytestmark = pytest.mark.slow  # four processes, an anchor and four deltas

FIELDS = {
    "state_gb",
    "ranks",
    "receivers",
    "link_gbps",
    "first_delta_s",
    "steady_delta_s",
    "bytes_delta",
    "publisher_extra_gb",
    "peak_rss_receiver_gb",
    "shard_gb",
    "held_gb",
    "bit_exact",
    "stages",
    "publisher_fixed_gb",
    "receiver_fixed_gb",
    "pinned",
    "anchor_every",
    "tensors",
    "publisher_cpu_s_per_gb",
    "receiver_cpu_s_per_gb",
    "per_tensor_us_publisher",
    "per_tensor_us_receiver",
}


def test_a_tiny_sharded_run_is_bit_exact_and_reports_every_field(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    gen = torch.Generator().manual_seed(0)
    state = {
        "layer.w": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
        "layer.b": torch.zeros(7, dtype=torch.bfloat16),
    }
    for v in range(5):
        torch.save(state, tmp_path / f"v{v}.pt")
        state = perturb(state, 0.02, seed=v + 1)
    tiles = 3
    small_gb = sum(t.numel() * 2 for t in state.values()) / 1e9
    rows = run_scenario(
        tmp_path, tiles * small_gb, tiles, ranks=2, receivers=1, links=[10.0, 25.0], per_link=2
    )
    assert [r["link_gbps"] for r in rows] == [10.0, 25.0] and [r["cold_first"] for r in rows] == [True, False]
    for row in rows:
        assert set(row) >= FIELDS
        assert row["bit_exact"] is True
        assert row["bytes_delta"] > 0 and row["steady_delta_s"] > 0
        assert row["shard_gb"] < row["held_gb"]  # a rank holds its half, the receiver all of it
        assert set(row["stages"]) == {"encode_s", "wire_s", "decode_s", "verify_s", "apply_s"}
        assert set(row["cpu"]) == {"publishers_cpu_s", "receiver_cpu_s"}
        assert row["cpu"]["publishers_cpu_s"] > 0 and row["cpu"]["receiver_cpu_s"] > 0
        # the fixed part (held before any version) is a part of the peak, on both sides
        assert 0 < row["publisher_fixed_gb"] <= row["publisher_extra_gb"]
        assert 0 < row["receiver_fixed_gb"] <= row["peak_rss_receiver_gb"]


def test_a_pinned_row_with_anchors_every_four_versions(tmp_path, monkeypatch):
    import os

    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("pinned rows need cores 0 and 1")
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    gen = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(256, 32, generator=gen).to(torch.bfloat16)}
    for v in range(6):
        torch.save(state, tmp_path / f"v{v}.pt")
        state = perturb(state, 0.02, seed=v + 1)
    small_gb = sum(t.numel() * 2 for t in state.values()) / 1e9
    (row,) = run_scenario(tmp_path, 2 * small_gb, 2, 1, 1, [25.0], 5, pinned=True, anchor_every=4)
    assert row["pinned"] is True and row["anchor_every"] == 4 and row["bit_exact"] is True
    assert row["kinds"] == ["delta", "delta", "delta", "anchor", "delta"]
    assert row["tensors"] == 2 and row["publisher_cpu_s_per_gb"] > 0


def test_the_one_core_bounds_read_both_states_and_emit_every_change():
    from benchmarks._sync_bound import one_core_bounds

    gen = torch.Generator().manual_seed(2)
    prev = {"w": torch.randn(1000, 64, generator=gen).to(torch.bfloat16)}
    new = perturb(prev, 0.01, seed=3)
    bounds = one_core_bounds(prev, new, gb=0.01)
    assert bounds["read_bound_s_per_gb"] > 0 and bounds["fused_kernel_s_per_gb"] > 0
    changed = bounds["bound_changed_fraction"]
    assert 0.005 < changed < 0.02
    assert bounds["bound_emitted_words"] == round(changed * (int(0.01e9) // 2 // 32 * 32))


def test_a_moe_shaped_row_sends_expert_matrices_and_is_bit_exact(tmp_path, monkeypatch):
    """``shape="moe"``: the ranks publish (and the receiver checks) the tiled state cut into
    32x64 expert matrices; each rank holds a dim-0 piece of every matrix."""
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    gen = torch.Generator().manual_seed(4)
    state = {
        "w": torch.randn(256, 64, generator=gen).to(torch.bfloat16),
        "b": torch.ones(7).to(torch.bfloat16),
    }
    for v in range(3):
        torch.save(state, tmp_path / f"v{v}.pt")
        state = perturb(state, 0.02, seed=v + 1)
    small_gb = sum(t.numel() * 2 for t in state.values()) / 1e9
    (row,) = run_scenario(tmp_path, 2 * small_gb, 2, 2, 1, [25.0], 2, shape="moe")
    assert row["shape"] == "moe" and row["bit_exact"] is True
    # per tile: 8 matrices of 32x64 and the 7-word rest; each rank holds a dim-0 piece of
    # all 9 (16 of a matrix's 32 rows, 4 or 3 of the rest's 7 words)
    assert row["tensors"] == 2 * 9 and row["receiver_tensors"] == 2 * 2 * 9
