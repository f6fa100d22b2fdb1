"""A pool's settings are one validated ``PoolConfig``: keyword settings are its fields, an
unknown one is a one-line error listing the known, and a rule's violation names the field."""

from __future__ import annotations

import pytest

from modal_rl.sandboxes import LocalProvider, PoolConfig, SandboxPool, SandboxSpec


def test_keyword_settings_are_the_configs_fields_applied_over_it():
    base = PoolConfig(max_live=8, name="base")
    pool = SandboxPool(LocalProvider(), SandboxSpec(), base, min_warm=2, handle_signals=False)
    assert pool.config == PoolConfig(max_live=8, name="base", min_warm=2, handle_signals=False)
    assert (pool.name, pool.max_live, pool.sizer.min_warm) == ("base", 8, 2)


def test_an_unknown_setting_is_one_line_listing_the_known():
    with pytest.raises(
        TypeError, match=r"unknown sandbox pool setting\(s\) max_warmth; the settings are: min_warm"
    ):
        SandboxPool(LocalProvider(), SandboxSpec(), max_warmth=3)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"min_warm": 5, "max_warm": 2}, "min_warm <= max_warm"),
        ({"max_live": 0}, "max_live >= 1"),
        ({"min_warm": 9, "max_live": 4, "max_warm": 9}, "cannot exceed max_live"),
        ({"claim_timeout_s": 0}, "claim_timeout_s must be > 0"),
        ({"max_retries": -1}, "max_retries must be >= 0"),
    ],
)
def test_each_rule_names_its_field(settings, field):
    with pytest.raises(ValueError, match=field):
        PoolConfig(**settings)
