"""The masked-sample group rule in slime's reward post-processing, against slime's own function.

``slime_modal.reward_groups.post_process_rewards`` (slime's ``--custom-reward-post-process-path``)
is compared with slime's real ``RolloutManager._post_process_rewards``, run in a child
interpreter on real ``slime.utils.types.Sample`` objects (slime at the pinned base of
``patches/slime``, from ``$SLIME_PATH`` or the fetched mirror; SGLang's client-side names from
``tests/_slime_cpu_boundary``, as in ``tests/slime_adapter/test_slime_rollout_manager.py``). Batches: five
groups of four with 0..4 masked (``remove_sample``, reward 0.0). Siblings must get what slime
gives the group without its masked samples; masked samples and lone survivors 0.0; a batch with
nothing masked exactly slime's answer. Skipped (one line) without a slime checkout.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tomllib
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime_modal import launch
from slime_modal.reward_groups import post_process_rewards

ROOT = Path(__file__).resolve().parents[2]
BOUNDARY = ROOT / "tests" / "_slime_cpu_boundary"
SERIES = ROOT / "patches" / "slime" / "series.toml"
MIRROR = Path("/work/.mirror/THUDM+slime/repo")
N, PROMPTS = 4, 5
SETTINGS = [  # (advantage_estimator, rewards_normalization, grpo_std_normalization)
    ("grpo", True, True),
    ("grpo", True, False),
    ("gspo", True, True),
    ("reinforce_plus_plus_baseline", True, True),
    ("grpo", False, True),
    ("ppo", True, True),
]

SLIME_SIDE = r"""
import json, sys
from argparse import Namespace
from types import SimpleNamespace
from slime.ray.rollout import RolloutManager
from slime.utils.types import Sample
manager = getattr(RolloutManager, "__ray_actor_class__", RolloutManager)
out = []
for case in json.loads(sys.stdin.read()):
    args = Namespace(**case["args"])
    samples = [Sample(reward=r, remove_sample=m) for r, m in zip(case["rewards"], case["masked"])]
    me = SimpleNamespace(args=args, custom_reward_post_process_func=None)
    out.append(manager._post_process_rewards(me, samples)[1])
print(json.dumps(out))
"""


def slime_args(estimator, normalise, by_std, n=N, prompts=PROMPTS) -> dict:
    return {
        "advantage_estimator": estimator,
        "rewards_normalization": normalise,
        "grpo_std_normalization": by_std,
        "n_samples_per_prompt": n,
        "rollout_batch_size": prompts,
        "reward_key": None,
    }


def masked_batch(seed=0):
    rng = random.Random(seed)
    masked = [i % N >= N - g for g in range(PROMPTS) for i in range(N)]  # group g: g masked
    rewards = [0.0 if m else round(rng.random(), 3) for m in masked]
    return rewards, masked


def sample(reward, masked):
    return SimpleNamespace(reward=reward, remove_sample=masked, get_reward_value=lambda args: reward)


def ours(args: dict, rewards, masked):
    return post_process_rewards(
        Namespace(**args), [sample(r, m) for r, m in zip(rewards, masked, strict=True)]
    )[1]


@pytest.fixture(scope="module")
def slime_fn(tmp_path_factory):
    """slime's own ``_post_process_rewards`` over a list of cases, in a child interpreter."""
    source = next(
        (Path(p) for p in (os.environ.get("SLIME_PATH"), str(MIRROR)) if p and Path(p).is_dir()), None
    )
    if source is None:
        pytest.skip("no slime checkout: set SLIME_PATH to a slime git checkout")
    tree = tmp_path_factory.mktemp("slime")
    commit = tomllib.loads(SERIES.read_text())["base"]["commit"]
    git_dir = ["--git-dir", str(source)] if (source / "HEAD").is_file() else ["-C", str(source)]
    archive = subprocess.run(["git", *git_dir, "archive", commit, "slime"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BOUNDARY), str(tree)])}

    def run(cases: list[dict]) -> list[list[float]]:
        proc = subprocess.run(
            [sys.executable, "-c", SLIME_SIDE],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


def test_siblings_as_slime_without_masked_samples_lone_and_masked_zero(slime_fn):
    rewards, masked = masked_batch()
    cases, whole_at, expected_at = [], {}, []
    for setting in SETTINGS:
        whole_at[setting] = len(cases)
        cases.append({"args": slime_args(*setting), "rewards": rewards, "masked": [False] * len(rewards)})
        for g in range(PROMPTS):  # each group alone, masked samples left out: slime's own answer
            rows = [i for i in range(g * N, (g + 1) * N) if not masked[i]]
            if len(rows) >= 2:
                args = slime_args(*setting, n=len(rows), prompts=1)
                cases.append(
                    {"args": args, "rewards": [rewards[i] for i in rows], "masked": [False] * len(rows)}
                )
                expected_at.append((setting, rows, len(cases) - 1))
    slime = slime_fn(cases)

    for setting in SETTINGS:
        whole = ours(slime_args(*setting), rewards, [False] * len(rewards))
        assert whole == pytest.approx(slime[whole_at[setting]], abs=1e-5)  # nothing masked: slime's
        got = ours(slime_args(*setting), rewards, masked)
        grouped = setting[0] in ("grpo", "gspo", "reinforce_plus_plus_baseline") and setting[1]
        if not grouped:  # slime's raw rewards, unchanged
            assert got == rewards
            continue
        counted = set()
        for s, rows, c in expected_at:
            if s == setting:
                assert [got[i] for i in rows] == pytest.approx(slime[c], abs=1e-5), (setting, rows)
                counted.update(rows)
        assert counted == {i for i in range(len(rewards)) if not masked[i] and i // N < 3}
        assert all(got[i] == 0.0 for i in range(len(rewards)) if i not in counted)
        assert got[12] == 0.0 and not masked[12]  # group 3's lone survivor


def test_slime_alone_lets_masked_samples_move_siblings(slime_fn):
    """Why the hook exists: slime's default counts a masked sample's 0.0 in its group's mean."""
    rewards, masked = masked_batch()
    case = {"args": slime_args("grpo", True, True), "rewards": rewards, "masked": masked}
    slime = slime_fn([case])[0]
    assert slime[4:7] != pytest.approx(ours(case["args"], rewards, masked)[4:7], abs=1e-3)


def test_rule_without_slime():
    """The same properties on the hook alone (no checkout needed)."""
    rewards, masked = masked_batch()
    got = ours(slime_args("grpo", True, False), rewards, masked)
    valid = [rewards[i] for i in range(4, 7)]  # group 1: three valid
    mean = sum(valid) / 3
    assert got[4:7] == pytest.approx([r - mean for r in valid])
    assert got[7] == 0.0 and got[12] == 0.0 and got[16:] == [0.0] * 4


def test_launcher_adds_the_hook_only_for_our_reward():
    ours_rm = ["--custom-rm-path", "slime_modal.reward.batched_reward_func", "--group-rm"]
    argv, added = launch.with_reward_groups(ours_rm)
    assert added == ["--custom-reward-post-process-path", "slime_modal.reward_groups.post_process_rewards"]
    assert argv == [*ours_rm, *added]
    own = [*ours_rm, "--custom-reward-post-process-path", "mine.post"]
    assert launch.with_reward_groups(own) == (own, [])
    other = ["--custom-rm-path", "mine.rm"]
    assert launch.with_reward_groups(other) == (other, [])
