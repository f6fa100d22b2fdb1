"""The e2e suite's authentication-cost columns: MACs grow with the frame, the trainer's one
signature per version does not, and the report sets both beside the steady version."""

from __future__ import annotations

from benchmarks._weight_sync_crypto import crypto_costs
from benchmarks.weight_sync_e2e import _crypto, render


def test_the_signature_costs_the_same_at_any_size_and_the_macs_grow():
    small, large = crypto_costs(1e5, 4, repeat=20), crypto_costs(64e6, 4, repeat=20)
    assert large["mac_s"] > 20 * small["mac_s"]
    for costs in (small, large):
        assert 0 < costs["sign_s"] < 0.01 and 0 < costs["verify_s"] < 0.01
        assert costs["signature_s"] == costs["sign_s"] + costs["verify_s"]
        assert costs["signature_cpu_s"] == costs["sign_s"] + 4 * costs["verify_s"]


def test_the_report_sets_macs_and_signatures_beside_each_steady_version():
    row = {
        "receivers": 1,
        "link_gbps": 1,
        "fanout": "direct",
        "state_gb": 0.05,
        "full_s": 0.3,
        "slime_s": 0.07,
        "v1_s": 0.05,
        "delta_s": 0.05,
        "first_delta_s": 0.05,
        "delta_steady_s": 0.05,
        "delta_per_version_s": [0.05, 0.05],
        "bytes_delta": 135_000,
        "bytes_slime_own": 270_000,
        "bytes_slime": 270_000,
        "pause_s": 0.01,
        "bit_exact": True,
        "full_keyless_s": 0.29,
        "delta_keyless_s": 0.05,
    }
    row |= _crypto(row)
    assert row["sig_over_steady"] == row["signature_s"] / 0.05 < 0.02
    text = render([row])
    assert "sign+verify/steady" in text and "trainer's signature and one receiver's check" in text
