"""``weight-sync-scale``'s plan without its processes: the MoE-shaped state is the tiled
trajectory's own words cut into expert matrices, and ``--only`` picks rows by name."""

import pytest
import torch

from benchmarks._weight_sync_data import EXPERT, expert_split, tiled_state
from benchmarks.weight_sync_scale import plan_rows, row_name, run
from modal_rl.run_key import RUN_KEY_ENV
from tests.weightsync_helpers import TEST_KEY


def test_expert_split_cuts_views_of_the_same_words_into_expert_matrices():
    g = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(3 * 2048 + 5, generator=g).to(torch.bfloat16),
        "w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "norm": torch.randn(384, generator=g).to(torch.bfloat16),
    }
    pairs = list(expert_split(tiled_state(state, 2)()))
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names))
    assert names[:5] == ["tile0.big.x0", "tile0.big.x1", "tile0.big.x2", "tile0.big.rest", "tile0.w.x0"]
    assert all(t.shape == EXPERT for n, t in pairs if ".x" in n)
    assert dict(pairs)["tile0.big.rest"].numel() == 5 and dict(pairs)["tile1.norm.rest"].numel() == 384
    for k in range(2):  # every word of every tile, in order, and no copy made
        for name, tensor in state.items():
            parts = [t.reshape(-1) for n, t in pairs if n.startswith(f"tile{k}.{name}.")]
            assert torch.equal(torch.cat(parts).view(torch.int16), tensor.reshape(-1).view(torch.int16))
            assert parts[0].data_ptr() == tensor.data_ptr()


def test_rows_have_unique_names_and_the_moe_rows_are_planned():
    for quick in (True, False):
        plan = plan_rows(quick)
        names = [row_name(*p[:5], p[6]) for p in plan]
        assert len(names) == len(set(names))
        assert {"moe-0.15gb-1x1-pinned", "moe-0.15gb-4x1"} <= set(names)
    assert "tiled-4gb-1x1-pinned" in [row_name(*p[:5], p[6]) for p in plan_rows(True)]


def test_only_refuses_an_unknown_row_by_naming_the_known_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    with pytest.raises(SystemExit, match="unknown rows \\['nope'\\].*moe-0.15gb-4x1"):
        run(quick=True, out=tmp_path, only="moe-0.15gb-4x1,nope")
