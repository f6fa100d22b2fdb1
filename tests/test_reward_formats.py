"""Honest programs in every test format score what they deserve, identically through verl's
``compute_score`` and slime's ``reward_func`` / ``batched_reward_func``, all-or-nothing and with
partial credit (``tests/_reward_formats.py``). Real bubblewrap sandboxes, the real runner."""

from __future__ import annotations

import asyncio
import functools
import math
from types import SimpleNamespace

import pytest
from _reward_exploits import label, response
from _reward_formats import FORMATS
from _sandboxes_helpers import needs_bwrap, no_processes_left

pytestmark = needs_bwrap
TIMEOUT_S = 5.0


@functools.cache
def verl_scores(partial: bool) -> dict:
    from modal_rl.sandboxes.shared import close_shared_pools
    from verl_modal.reward import compute_score

    async def main():
        try:
            outs = await asyncio.gather(
                *(
                    compute_score(
                        "code",
                        response(prog),
                        label(tests),
                        {},
                        exec_timeout_s=TIMEOUT_S,
                        partial=partial,
                        backend="local",
                        max_live=4,
                    )
                    for tests, prog, _, _ in FORMATS.values()
                ),
                return_exceptions=True,
            )
        finally:
            await close_shared_pools()
        return dict(zip(FORMATS, outs, strict=True))

    out = asyncio.run(main())
    no_processes_left()
    # a masked sample is a flagged result in verl (sandbox_masked), remove_sample in slime
    return {
        k: v if isinstance(v, BaseException) else "masked" if v["sandbox_masked"] else v["score"]
        for k, v in out.items()
    }


@functools.cache
def slime_scores(partial: bool, batched: bool) -> dict:
    from slime_modal.config import close_rollout_pools
    from slime_modal.reward import batched_reward_func, reward_func

    args = SimpleNamespace(modal_rl_reward={"timeout_s": TIMEOUT_S, "partial": partial})
    samples = [
        SimpleNamespace(index=i, response=response(p), label=label(t), metadata={}, remove_sample=False)
        for i, (t, p, _, _) in enumerate(FORMATS.values())
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
    return {n: ("masked" if s.remove_sample else v) for n, s, v in zip(FORMATS, samples, out, strict=True)}


def _expected(name: str, partial: bool) -> float:
    return FORMATS[name][3] if partial else FORMATS[name][2]


@pytest.mark.parametrize("partial", [False, True], ids=["all-or-nothing", "partial"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_verl_compute_score(name, partial):
    got = verl_scores(partial)[name]
    assert isinstance(got, float) and math.isclose(got, _expected(name, partial)), f"{name}: {got!r}"


@pytest.mark.parametrize("partial", [False, True], ids=["all-or-nothing", "partial"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_slime_reward_func(name, partial):
    got = slime_scores(partial, False)[name]
    assert isinstance(got, float) and math.isclose(got, _expected(name, partial)), f"{name}: {got!r}"


@pytest.mark.parametrize("partial", [False, True], ids=["all-or-nothing", "partial"])
def test_frameworks_score_every_format_identically(partial):
    assert verl_scores(partial) == slime_scores(partial, False) == slime_scores(partial, True)
