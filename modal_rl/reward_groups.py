"""Group-relative rewards with masked samples: which samples a group's statistics count.

GRPO-style estimators score a sample against its siblings (the other samples drawn for the
same prompt). A masked sample (its sandbox failed, its tests were no tests, its engine died)
has no real reward, so it must not move its siblings' mean or standard deviation; and a
sample left with no valid sibling has no baseline at all, so it must not be trained on its raw
score (which is what a group of one gives: mean 0, std 1 in verl). The rule, the same in
every framework adapter:

- a sample *counts* when it is valid and at least one other valid sample shares its group;
- a group's statistics are computed over its counted samples only;
- every sample that does not count (masked, or valid but alone) gets advantage 0.

Both adapters apply it at their own seam: verl's advantage estimators
(``verl_modal.group_advantage``) and slime's reward post-processing
(``slime_modal.reward_groups``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

MIN_VALID = 2  # a baseline needs a sibling: below this a group contributes no advantage


def counted(groups: Sequence[Hashable], valid: Sequence[bool]) -> list[bool]:
    """For each sample: does it take part in its group's statistics (valid, with a valid sibling)."""
    if len(groups) != len(valid):
        raise ValueError(f"{len(groups)} group ids for {len(valid)} validity flags")
    sizes = Counter(g for g, ok in zip(groups, valid, strict=True) if ok)
    return [bool(ok) and sizes[g] >= MIN_VALID for g, ok in zip(groups, valid, strict=True)]


def normalised(
    rewards: Sequence[float],
    groups: Sequence[Hashable],
    valid: Sequence[bool],
    *,
    by_std: bool,
    epsilon: float = 1e-6,
) -> list[float]:
    """Each counted reward minus its group's mean over counted rewards (divided by their sample
    standard deviation plus ``epsilon`` when ``by_std``); 0.0 for every other sample."""
    keep = counted(groups, valid)
    members: dict[Hashable, list[float]] = {}
    for r, g, k in zip(rewards, groups, keep, strict=True):
        if k:
            members.setdefault(g, []).append(float(r))
    stats = {}
    for g, rs in members.items():
        mean = math.fsum(rs) / len(rs)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        stats[g] = (mean, std)
    out = []
    for r, g, k in zip(rewards, groups, keep, strict=True):
        if not k:
            out.append(0.0)
            continue
        mean, std = stats[g]
        out.append((float(r) - mean) / (std + epsilon) if by_std else float(r) - mean)
    return out
