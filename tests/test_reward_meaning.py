"""Honest programs whose tests need Python's meaning across the program boundary score 1.0, the
exploits that bind the program's names into the tests, cross control flow or count units by
syntax score 0.0, and tests that cannot judge a program are masked as ``bad_tests`` — identically
through verl's ``compute_score`` and slime's ``reward_func`` / ``batched_reward_func``, all or
nothing and with partial credit (``tests/_reward_meaning.py``). Real bubblewrap sandboxes, the
real runner."""

from __future__ import annotations

import asyncio
import functools
import math
from types import SimpleNamespace

import pytest
from _reward_exploits import label, response
from _reward_meaning import CASES
from _sandboxes_helpers import needs_bwrap, no_processes_left

pytestmark = [needs_bwrap, pytest.mark.slow]
TIMEOUT_S = 15.0  # the 300k-item and many-call tests on a loaded 2-core host
MASKED = "masked"


def _verl_value(out):
    """verl's answer for one sample: its score, or MASKED (a flagged result or a raised error)."""
    if isinstance(out, BaseException):
        return MASKED
    if out.get("sandbox_masked") or out.get("masked"):
        return MASKED
    return out["score"]


@functools.cache
def verl_scores(partial: bool) -> dict:
    from modal_rl.sandboxes.shared import close_shared_pools
    from verl_modal.reward import compute_score

    async def main():
        try:
            return await asyncio.gather(
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
                    for tests, prog, _, _ in CASES.values()
                ),
                return_exceptions=True,
            )
        finally:
            await close_shared_pools()

    out = asyncio.run(main())
    no_processes_left()
    return {name: _verl_value(o) for name, o in zip(CASES, out, strict=True)}


@functools.cache
def slime_scores(partial: bool, batched: bool) -> dict:
    from slime_modal.config import close_rollout_pools
    from slime_modal.reward import batched_reward_func, reward_func

    args = SimpleNamespace(modal_rl_reward={"timeout_s": TIMEOUT_S, "partial": partial})
    samples = [
        SimpleNamespace(index=i, response=response(p), label=label(t), metadata={}, remove_sample=False)
        for i, (t, p, _, _) in enumerate(CASES.values())
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
    return {n: (MASKED if s.remove_sample else v) for n, s, v in zip(CASES, samples, out, strict=True)}


def _expected(name: str, partial: bool):
    want = CASES[name][3] if partial else CASES[name][2]
    return MASKED if want is None else want


def _same(got, want) -> bool:
    return got == want if MASKED in (got, want) else isinstance(got, float) and math.isclose(got, want)


@pytest.mark.parametrize("partial", [False, True], ids=["all_or_nothing", "partial"])
def test_verl_compute_score_keeps_pythons_meaning(partial):
    got = verl_scores(partial)
    wrong = {n: (got[n], _expected(n, partial)) for n in CASES if not _same(got[n], _expected(n, partial))}
    assert not wrong, wrong


@pytest.mark.parametrize("partial", [False, True], ids=["all_or_nothing", "partial"])
def test_slime_reward_func_keeps_pythons_meaning(partial):
    got = slime_scores(partial, False)
    wrong = {n: (got[n], _expected(n, partial)) for n in CASES if not _same(got[n], _expected(n, partial))}
    assert not wrong, wrong


@pytest.mark.parametrize("partial", [False, True], ids=["all_or_nothing", "partial"])
def test_both_frameworks_agree_sample_by_sample(partial):
    assert verl_scores(partial) == slime_scores(partial, False) == slime_scores(partial, True)
