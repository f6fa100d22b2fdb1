"""Honest programs whose tests need Python's meaning across the program boundary score 1.0, the
exploits that bind the program's names into the tests, cross control flow or count units by
syntax score 0.0, and tests that cannot judge a program are masked as ``bad_tests`` — identically
through verl's ``compute_score`` and slime's ``reward_func`` / ``batched_reward_func``, all or
nothing and with partial credit (``tests/_reward_meaning.py``). Real bubblewrap sandboxes, the
real runner."""

from __future__ import annotations

import functools
import math

import pytest

import tests._reward_frameworks as frameworks
from tests._reward_meaning import CASES
from tests._sandboxes_helpers import needs_bwrap

pytestmark = [needs_bwrap, pytest.mark.slow]
TIMEOUT_S = 15.0  # the 300k-item and many-call tests on a loaded 2-core host
MASKED = frameworks.MASKED


@functools.cache
def verl_scores(partial: bool) -> dict:
    return frameworks.verl_scores(CASES, partial, TIMEOUT_S)


@functools.cache
def slime_scores(partial: bool, batched: bool) -> dict:
    return frameworks.slime_scores(CASES, partial, batched, TIMEOUT_S)


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
