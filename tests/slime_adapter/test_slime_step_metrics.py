"""slime's runs log the same ``modal_rl/`` names through slime's own logging path: slime's
real rollout logger (from a slime checkout at the ``patches/slime`` base) calls our custom
rollout log function, and slime's tensorboard writer gets our numbers at the rollout's step,
beside slime's own ``rollout/*``. Megatron and SGLang cannot run here, so the rollout manager
around the logger is this test: it calls ``log_rollout_data`` as ``RolloutManager.generate``
does, with real slime ``Sample`` objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIRROR = Path("/work/.mirror/THUDM+slime/repo")
SERIES = ROOT / "patches" / "slime" / "series.toml"


@pytest.fixture(scope="module")
def slime_tree(tmp_path_factory) -> Path:
    source = next(
        (Path(p) for p in (os.environ.get("SLIME_PATH"), str(MIRROR)) if p and Path(p).is_dir()), None
    )
    if source is None:
        pytest.skip("no slime checkout: set SLIME_PATH to a slime git checkout")
    base = tomllib.loads(SERIES.read_text())["base"]["commit"]
    tree = tmp_path_factory.mktemp("slime-src")
    archive = subprocess.run(
        ["git", "-C", str(source), "archive", base, "slime"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def test_slime_logs_the_modal_rl_numbers_through_its_own_tensorboard_path(slime_tree, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(slime_tree), str(ROOT)]),
        "WANDB_MODE": "disabled",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_slime_log_child.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def at(name: str) -> dict[int, float]:
        assert name in tags, sorted(tags)
        return {e.step: e.value for e in events.Scalars(name)}

    # slime's own rollout metrics, and ours, at the same rollout steps
    assert sorted(at("rollout/response_len/mean")) == [0, 1, 2]
    assert at("modal_rl/weight_sync/syncs") == {0: 0.0, 1: 1.0, 2: 1.0}
    assert at("modal_rl/weight_sync/deltas") == {0: 0.0, 1: 1.0, 2: 1.0}
    sent = at("modal_rl/weight_sync/sent_mib")
    assert sent[0] == 0 and 1.0 < sent[1] < 1.01 and 2.0 < sent[2] < 2.01  # shard + index
    assert at("modal_rl/masked/sandbox") == {0: 0.0, 1: 1.0, 2: 2.0}
    assert "modal_rl/weight_sync/seconds" not in tags  # not known in slime's rollout process
    # the samples' versions, as slime recorded them from SGLang's responses, against
    # train_async.py's trainer version (rollout r trains at r + 1)
    assert at("modal_rl/async/trainer_version") == {0: 1.0, 1: 2.0, 2: 3.0}
    assert at("modal_rl/async/staleness_max") == {0: 0.0, 1: 1.0, 2: 2.0}  # mixed: charged to its oldest
    assert at("modal_rl/async/samples_mixed_versions") == {0: 0.0, 1: 0.0, 2: 1.0}
    assert at("modal_rl/async/versions_per_sample") == {0: 1.0, 1: 1.0, 2: 1.25}
    assert at("modal_rl/async/samples_without_versions") == {0: 0.0, 1: 0.0, 2: 0.0}
    assert sorted(at("modal_rl/async/engine_idle_s")) == [1, 2]  # none before the first rollout
    # the same numbers beside the parts dir, for python -m modal_rl.report
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["data"]["modal_rl/masked/samples"] == 2.0
    # the rollout's own means (rewards 0, 1, 0, 1; lengths 1..4) for the report's reward plot
    assert rows[2]["data"]["rollout/raw_reward"] == 0.5 and rows[2]["data"]["rollout/response_lengths"] == 2.5
    from modal_rl.report.page import write

    page = write(tmp_path).read_text()
    # reward and length, weight sync, masks
    assert "<span id='step-count'>3</span>" in page and page.count("<svg") == 3
