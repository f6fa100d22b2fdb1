"""The masked-sample group rule, through verl 0.9.1's own advantage estimators.

Batches are built by hand: five groups of four samples with 0..4 of them masked (all-zero
``response_mask``, as ``verl_modal.sample_mask`` and verl's batch padding leave a row). For every
estimator the wrapper covers, verl's real function (unwrapped, ``__wrapped__``) computed on the
group *without* its masked rows is the reference: siblings must get exactly those advantages;
masked rows and lone survivors 0. Masked rows are tried in their prompt's ``uid`` and in a uid
of their own (what verl's invalid-sample seam and our agent-loop shim give them). The last
tests go through verl's trainer path (``ray_trainer.compute_advantage``), with the wrapper
installed by our ``verl.plugins`` entry point in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from verl.trainer.config import AlgoConfig  # noqa: E402

from verl_modal import group_advantage  # noqa: E402

LENGTH = 6
MASKED_PER_GROUP = (0, 1, 2, 3, 4)
ESTIMATORS = [
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "gdpo",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]


def batch(own_uid_for_masked: bool, seed: int = 0):
    """Rows of five groups of four, group j with j masked rows (the last j of the group)."""
    gen = torch.Generator().manual_seed(seed)
    rows, uids, masked = [], [], []
    for g, n_masked in enumerate(MASKED_PER_GROUP):
        for i in range(4):
            is_masked = i >= 4 - n_masked
            length = 2 + (g + i) % (LENGTH - 1)
            mask = torch.zeros(LENGTH)
            if not is_masked:
                mask[:length] = 1
            score = float(torch.rand(1, generator=gen)) if not is_masked else 0.0
            reward = torch.zeros(LENGTH)
            reward[max(int(mask.sum()) - 1, 0)] = score
            rows.append((reward, mask))
            uids.append(f"masked-{g}-{i}" if (is_masked and own_uid_for_masked) else f"prompt-{g}")
            masked.append(is_masked)
    rewards = torch.stack([r for r, _ in rows])
    masks = torch.stack([m for _, m in rows])
    return rewards, masks, np.array(uids, dtype=object), masked


def call(fn, rewards, masks, uids, rows=None):
    """``fn`` on the batch (``rows``: a boolean selection of it, per-row inputs included)."""
    gen = torch.Generator().manual_seed(1)
    old_log_probs, sum_pi_squared = (
        -torch.rand(rewards.shape, generator=gen),
        torch.rand(rewards.shape, generator=gen),
    )
    if rows is not None:
        at = torch.tensor(rows)
        rewards, masks, uids = rewards[at], masks[at], uids[np.array(rows)]
        old_log_probs, sum_pi_squared = old_log_probs[at], sum_pi_squared[at]
    kwargs = {"token_level_rewards": rewards, "response_mask": masks, "index": uids}
    if "optimal_token_baseline" in fn.__name__ or "multi_turn" in fn.__name__:
        kwargs["old_log_probs"] = old_log_probs
        kwargs["sum_pi_squared"] = sum_pi_squared
    else:
        kwargs["config"] = AlgoConfig()
    return fn(**kwargs)


@pytest.fixture(scope="module", autouse=True)
def installed():
    group_advantage.install()


@pytest.mark.parametrize("own_uid", [False, True], ids=["prompt-uid", "own-uid"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_siblings_as_without_masked_rows_and_lone_rows_zero(name, own_uid):
    wrapped = core_algos.get_adv_estimator_fn(name)
    original = wrapped.__wrapped__
    rewards, masks, uids, masked = batch(own_uid)
    adv, ret = call(wrapped, rewards, masks, uids)

    # reference: verl's own estimator on the groups with >= 2 valid rows, masked rows left out
    group_valid = {
        u: sum(1 for v, m in zip(uids, masked, strict=True) if v == u and not m) for u in set(uids)
    }
    keep = [not m and group_valid[u] >= 2 for u, m in zip(uids, masked, strict=True)]
    at = torch.tensor(keep)
    ref_adv, ref_ret = call(original, rewards, masks, uids, rows=keep)

    torch.testing.assert_close(adv[at], ref_adv)
    torch.testing.assert_close(ret[at], ref_ret)
    assert not adv[~at].any() and not ret[~at].any()
    lone = [i for i, (u, m) in enumerate(zip(uids, masked, strict=True)) if not m and group_valid[u] == 1]
    assert lone == [12]  # group 3: three of four masked
    assert adv.shape == rewards.shape


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_unwrapped_verl_trains_the_lone_survivor_on_its_raw_score(name):
    """Why the wrapper exists: verl alone gives group 3's lone valid row a non-zero advantage."""
    original = core_algos.get_adv_estimator_fn(name).__wrapped__
    rewards, masks, uids, _ = batch(own_uid_for_masked=True)
    adv, _ = call(original, rewards, masks, uids)
    assert adv[12].abs().sum() > 0


@pytest.mark.parametrize("name", ESTIMATORS)
def test_no_masked_rows_is_verl_exactly(name):
    wrapped = core_algos.get_adv_estimator_fn(name)
    rewards, masks, uids, masked = batch(own_uid_for_masked=False)
    full = [u == "prompt-0" for u in uids]  # the one group with nothing masked
    got = call(wrapped, rewards, masks, uids, rows=full)
    want = call(wrapped.__wrapped__, rewards, masks, uids, rows=full)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_every_row_masked_or_alone_is_all_zero():
    wrapped = core_algos.get_adv_estimator_fn("grpo")
    rewards, masks, uids, masked = batch(own_uid_for_masked=False)
    adv, ret = call(wrapped, rewards, masks, uids, rows=[u in ("prompt-3", "prompt-4") for u in uids])
    assert not adv.any() and not ret.any()


def seam_grpo(
    token_level_rewards,
    response_mask,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    valid_mask=None,
):
    """GRPO as ``patches/verl-main/0005`` defines it, written from its docstring: a row whose
    ``valid_mask`` is False does not vote and gets 0; a group with an invalid row and fewer
    than two valid rows gets 0; any other group as verl's GRPO (a group of one: mean 0, std 1)."""
    scores = token_level_rewards.sum(-1)
    valid = [True] * len(scores) if valid_mask is None else valid_mask.bool().tolist()
    members: dict = {}
    for s, u, v in zip(scores.tolist(), list(index), valid, strict=True):
        if v:
            members.setdefault(u, []).append(s)
    masked_groups = {u for u, v in zip(list(index), valid, strict=True) if not v}
    out = torch.zeros_like(scores)
    for i, (s, u, v) in enumerate(zip(scores.tolist(), list(index), valid, strict=True)):
        group = members.get(u, [])
        if not v or (u in masked_groups and len(group) < 2):
            continue
        mean, std = (0.0, 1.0) if len(group) == 1 else (float(np.mean(group)), float(np.std(group, ddof=1)))
        out[i] = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def test_the_seams_valid_mask_and_the_wrapper_agree():
    """On a verl whose GRPO takes ``valid_mask`` (the trainer passes ``response_mask.any(-1)``)
    the wrapper still runs: sliced to the counted rows it passes the seam an all-valid mask,
    and the result is the seam's own, which is the group rule's on every group of four. The
    seam keeps a masked row's uid (the batch's prompt-uid form); a row moved to a uid of its
    own leaves its prompt group looking whole to the seam, which only the wrapper catches."""
    rewards, masks, uids, _ = batch(own_uid_for_masked=False)
    valid = masks.any(dim=-1)
    seam_adv, _ = seam_grpo(rewards, masks, uids, valid_mask=valid)
    wrapped_adv, _ = group_advantage.wrap(seam_grpo)(
        token_level_rewards=rewards, response_mask=masks, index=uids, valid_mask=valid
    )
    verl_rule_adv, _ = core_algos.get_adv_estimator_fn("grpo")(
        token_level_rewards=rewards, response_mask=masks, index=uids, config=AlgoConfig()
    )
    torch.testing.assert_close(wrapped_adv, seam_adv)
    torch.testing.assert_close(verl_rule_adv, seam_adv)
    assert seam_adv[12].abs().sum() == 0  # the lone survivor of group 3: no signal either way
    assert seam_adv[0].abs().sum() > 0


def test_install_is_idempotent_and_covers_grpo_module_name():
    group_advantage.install()
    group_advantage.install()
    fn = core_algos.get_adv_estimator_fn("grpo")
    assert core_algos.compute_grpo_outcome_advantage is fn
    assert not getattr(fn.__wrapped__, "__wrapped__", None)  # wrapped once
    for name in group_advantage.GROUPED:
        assert core_algos.ADV_ESTIMATOR_REGISTRY[name].__wrapped__ is not None


TRAINER_PATH = r"""
import json, sys
import numpy as np, torch
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.config import AlgoConfig
data = json.loads(sys.argv[1])
out = {}
for name in ("grpo", "rloo"):
    batch = DataProto.from_dict(
        tensors={"token_level_rewards": torch.tensor(data[0]), "response_mask": torch.tensor(data[1])},
        non_tensors={"uid": np.array(data[2], dtype=object)},
    )
    res = compute_advantage(batch, adv_estimator=name, config=AlgoConfig())
    out[name] = res.batch["advantages"].tolist()
# the V1 trainer's path: GRPO over each session's final output, keys "{uid}_{session}_{index}"
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories
batch = DataProto.from_dict(
    tensors={"token_level_rewards": torch.tensor(data[0]), "response_mask": torch.tensor(data[1])},
    non_tensors={"uid": np.array(data[2], dtype=object)},
)
keys = [f"{u}_{i}_0" for i, u in enumerate(data[2])]
res = compute_advantage_for_multi_trajectories(batch, keys, adv_estimator="grpo", config=AlgoConfig())
out["v1"] = res.batch["advantages"].tolist()
out["wrapped"] = bool(getattr(core_algos.get_adv_estimator_fn("grpo"), "__wrapped__", None))
print(json.dumps(out))
"""


def test_trainer_path_in_a_fresh_interpreter_uses_the_rule():
    """verl's own ``compute_advantage`` (GRPO by module name, RLOO through the registry) and the
    V1 trainer's ``compute_advantage_for_multi_trajectories``, with the rule installed by the
    ``verl.plugins`` entry point alone."""
    rewards, masks, uids, masked = batch(own_uid_for_masked=True)
    arg = json.dumps([rewards.tolist(), masks.tolist(), list(uids)])
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER_PATH, arg], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["wrapped"]
    for name in ("grpo", "rloo", "v1"):
        adv = torch.tensor(out[name])
        want, _ = call(
            core_algos.get_adv_estimator_fn("rloo" if name == "rloo" else "grpo"), rewards, masks, uids
        )
        torch.testing.assert_close(adv, want)
        assert not adv[12].any()  # the lone survivor
        assert adv[:4].abs().sum() > 0  # the full group still learns
