"""slime reward post-processing under the masked-sample group rule (``modal_rl.reward_groups``).

    --custom-reward-post-process-path slime_modal.reward_groups.post_process_rewards

(``python -m slime_modal`` adds it when ``--custom-rm-path`` names ``slime_modal.reward`` and no
post-process function is set.) slime's default post-processing normalises rewards per group
(``RolloutManager._post_process_rewards``: for ``grpo``/``gspo``/``cispo`` and
``reinforce_plus_plus_baseline`` with ``--rewards-normalization``, reward minus the group's
mean, divided by its std + 1e-6 for the first three with ``--grpo-std-normalization``). A
masked sample (``sample.remove_sample``, reward 0.0) is in that mean and std, and a group left
with one valid sample gives it ``r - r = 0`` only by accident of the mean. Here, with the same
groups slime forms (consecutive blocks of ``--n-samples-per-prompt`` when the batch is whole,
else the whole batch as one group, as slime does), the statistics count only valid samples
with a valid sibling; every other sample gets 0.0. Other estimators get slime's answer
unchanged (the raw rewards).

Invariant: returns ``(raw_rewards, rewards)`` as slime's own function does, one entry per sample,
in order; with no masked sample the rewards equal slime's (up to float32 rounding).
"""

from __future__ import annotations

from typing import Any

from modal_rl.reward_groups import normalised

GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_NORMALISED = ("grpo", "gspo", "cispo")
FLAG = "--custom-reward-post-process-path"
PATH = "slime_modal.reward_groups.post_process_rewards"
EPSILON = 1e-6  # slime's


def group_ids(args: Any, count: int) -> list[int]:
    """The group of each of ``count`` samples, as slime's post-processing forms them."""
    n = args.n_samples_per_prompt
    if count == n * args.rollout_batch_size:
        return [i // n for i in range(count)]
    return [0] * count


def post_process_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """slime's ``custom_reward_post_process_func(args, samples)`` (module docstring)."""
    raw = [sample.get_reward_value(args) for sample in samples]
    if args.advantage_estimator not in GROUP_NORMALISED or not args.rewards_normalization:
        return raw, raw
    by_std = args.advantage_estimator in STD_NORMALISED and bool(args.grpo_std_normalization)
    valid = [not getattr(sample, "remove_sample", False) for sample in samples]
    return raw, normalised(raw, group_ids(args, len(samples)), valid, by_std=by_std, epsilon=EPSILON)
