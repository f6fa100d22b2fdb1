"""The masked-sample group rule (``modal_rl.reward_groups``) for verl's advantage estimators.

verl 0.9.1 computes group-relative advantages from ``uid`` groups; a masked sample
(``verl_modal.sample_mask``: all-zero ``response_mask``) still has a row, and a group whose other
rows are masked is a group of one, which verl's GRPO and RLOO give mean 0 (and std 1): the
lone sample's raw score becomes its advantage. So every group-relative estimator in verl's
registry (:data:`GROUPED`) is wrapped, once, when ``verl.trainer.ppo.core_algos`` loads:

- a row is *valid* when its ``response_mask`` has any 1 (our masked samples, an engine-aborted
  response and verl's own batch padding, ``verl/trainer/ppo/padding_utils.py``, all have none);
- verl's own estimator runs on the rows that count (valid, with a valid sibling in their
  ``uid``): masked rows are out of every group, whatever ``uid`` they carry;
- every other row gets advantage and return 0.

With no masked rows and no group of one the wrapper returns exactly what verl's estimator does.
Where verl's GRPO takes a ``valid_mask`` (the upstream form of this rule,
``patches/verl-main/0005``: invalid rows do not vote, a group they leave with fewer than two
valid rows gets 0) the wrapper hands it the counted rows only, every one valid, so both give
the same advantages for every group of two or more samples (``preflight.check_group_size``).
Registered in verl's registry under the same names (``get_adv_estimator_fn``, which the trainer
uses for all but GRPO), and as ``core_algos.compute_grpo_outcome_advantage``, the name verl's
``compute_advantage`` calls GRPO by (no registry lookup on that path).

Invariants: :func:`install` is idempotent; the original estimator always computes the values
that count (nothing here does arithmetic on advantages); row order is kept.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from modal_rl.reward_groups import counted

TARGET = "verl.trainer.ppo.core_algos"
# Estimators that compare a row with its uid group (verl 0.9.1's registry, by name).
GROUPED = (
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
)
# Per-row arguments the estimators take (first dimension = rows); the two batch dicts hold
# per-row entries too (GDPO reads its reward dimensions from them). ``valid_mask``: the
# argument GRPO takes where verl has the masked-sample seam (``patches/verl-main/0005``).
ROW_ARGS = frozenset(
    {
        "token_level_rewards",
        "response_mask",
        "index",
        "old_log_probs",
        "sum_pi_squared",
        "rollout_is_weights",
        "valid_mask",
    }
)
ROW_DICTS = frozenset({"non_tensor_batch", "batch"})
_MARK = "__verl_modal_group_rule__"


def _rows(value: Any, keep):
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {k: _rows(v, keep) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [v for v, k in zip(value, keep.tolist(), strict=True) if k]
    if isinstance(value, np.ndarray):
        return value[keep.numpy()]
    return value[keep.to(value.device)]  # a tensor or a TensorDict


def wrap(estimator: Callable) -> Callable:
    """``estimator`` under the group rule (module docstring)."""
    if getattr(estimator, _MARK, False):
        return estimator
    import torch

    signature = inspect.signature(estimator)
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(estimator)
    def with_group_rule(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        params = bound.arguments
        params.update(params.pop(extra, None) or {})
        rewards, mask = params["token_level_rewards"], params["response_mask"]
        index = params.get("index")
        valid = (mask != 0).any(dim=-1).cpu()
        # group ids as Python values: a tensor's elements hash by identity (a group each)
        groups = index.tolist() if hasattr(index, "tolist") else list(index) if index is not None else None
        groups = groups if groups is not None else [0] * len(valid)
        keep = torch.tensor(counted(groups, valid.tolist()), dtype=torch.bool)
        if bool(keep.all()):
            return estimator(**params)
        advantages = torch.zeros_like(rewards)
        returns = torch.zeros_like(rewards)
        if bool(keep.any()):
            sliced = {
                k: (_rows(v, keep) if k in ROW_ARGS or k in ROW_DICTS else v) for k, v in params.items()
            }
            adv, ret = estimator(**sliced)
            at = keep.to(rewards.device)
            advantages, returns = advantages.to(adv.dtype), returns.to(ret.dtype)
            advantages[at], returns[at] = adv, ret
        return advantages, returns

    setattr(with_group_rule, _MARK, True)
    return with_group_rule


def install() -> None:
    """Wrap the :data:`GROUPED` estimators in verl's registry and GRPO's module name (idempotent)."""
    core_algos = sys.modules[TARGET]
    registry = core_algos.ADV_ESTIMATOR_REGISTRY
    for name in GROUPED:
        if name in registry:
            registry[name] = wrap(registry[name])
    core_algos.compute_grpo_outcome_advantage = registry["grpo"]
