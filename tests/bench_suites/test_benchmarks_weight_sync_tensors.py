"""The per-tensor suite's measurement: both paths run, frames byte-identical, receivers bit-exact."""

import pytest

from benchmarks.weight_sync_tensors import measure
from modal_rl.weightsync.codec import fused

pytestmark = pytest.mark.skipif(not fused.ready(), reason="the layouts need numba")


@pytest.mark.parametrize("coding,sharded", [(1, False), (2, True)])
def test_a_small_moe_row_is_identical_and_exact(coding, sharded):
    row = measure(layers=1, versions=2, coding=coding, sharded=sharded)
    assert row["frames_identical"] and row["bit_exact"]
    assert row["tensors"] == (2 + 3 * 256 + 1)
    for side in ("pub_new", "pub_old", "rx_new", "rx_old"):
        assert row[f"per_tensor_us_{side}"] > 0
