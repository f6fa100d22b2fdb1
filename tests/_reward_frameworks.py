"""Scoring a set of samples through both frameworks' reward entry points, as they would call
them: verl's ``compute_score`` (async ``custom_reward_function``) and slime's ``reward_func`` /
``batched_reward_func``, each with the shared local bubblewrap pool, closed afterwards.

``cases`` maps a name to ``(tests, program, ...)``; the answer maps each name to its score, or
``MASKED`` (verl's flagged result, slime's ``remove_sample``), or the exception verl raised."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tests._reward_exploits import label, response
from tests._sandboxes_helpers import no_processes_left

MASKED = "masked"


def verl_scores(cases: dict, partial: bool, timeout_s: float) -> dict:
    from modal_rl.sandboxes.shared import close_shared_pools
    from verl_modal.reward import compute_score

    async def main():
        try:
            return await asyncio.gather(
                *(
                    compute_score(
                        "code",
                        response(case[1]),
                        label(case[0]),
                        {},
                        exec_timeout_s=timeout_s,
                        partial=partial,
                        backend="local",
                        max_live=4,
                    )
                    for case in cases.values()
                ),
                return_exceptions=True,
            )
        finally:
            await close_shared_pools()

    out = asyncio.run(main())
    no_processes_left()
    return {
        name: v if isinstance(v, BaseException) else MASKED if v["sandbox_masked"] else v["score"]
        for name, v in zip(cases, out, strict=True)
    }


def slime_scores(cases: dict, partial: bool, batched: bool, timeout_s: float) -> dict:
    from slime_modal.config import close_rollout_pools
    from slime_modal.reward import batched_reward_func, reward_func

    args = SimpleNamespace(modal_rl_reward={"timeout_s": timeout_s, "partial": partial})
    samples = [
        SimpleNamespace(
            index=i, response=response(case[1]), label=label(case[0]), metadata={}, remove_sample=False
        )
        for i, case in enumerate(cases.values())
    ]

    async def main():
        try:
            if batched:
                return await batched_reward_func(args, samples)
            return await asyncio.gather(*(reward_func(args, s) for s in samples))
        finally:
            await close_rollout_pools()

    out = asyncio.run(main())
    no_processes_left()
    return {n: (MASKED if s.remove_sample else v) for n, s, v in zip(cases, samples, out, strict=True)}
