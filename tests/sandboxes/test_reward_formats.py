"""Honest programs in every test format score what they deserve, identically through verl's
``compute_score`` and slime's ``reward_func`` / ``batched_reward_func``, all-or-nothing and with
partial credit (``tests/_reward_formats.py``). Real bubblewrap sandboxes, the real runner."""

from __future__ import annotations

import functools
import math

import pytest

import tests._reward_frameworks as frameworks
from tests._reward_formats import FORMATS
from tests._sandboxes_helpers import needs_bwrap

pytestmark = needs_bwrap
TIMEOUT_S = 5.0


@functools.cache
def verl_scores(partial: bool) -> dict:
    return frameworks.verl_scores(FORMATS, partial, TIMEOUT_S)


@functools.cache
def slime_scores(partial: bool, batched: bool) -> dict:
    return frameworks.slime_scores(FORMATS, partial, batched, TIMEOUT_S)


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
