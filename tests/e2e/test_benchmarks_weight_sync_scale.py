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
