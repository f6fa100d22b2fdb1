"""Public datasets' test shapes (APPS/TACO stdin/stdout and ``fn_name`` calls, lists of lines,
float answers, TACO LeetCode ``class Solution``, LiveCodeBench stdin and functional) score what
each program deserves through ``scoring.score_sample``: real bubblewrap sandboxes, the real
runner (``tests/_dataset_formats.py``). Then the parsing and the comparison rule alone."""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import math

import pytest

from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.scoring import score_sample
from modal_rl.sandboxes.stdio_compare import same_output, stdout_budget
from modal_rl.sandboxes.testformats import call_test_code, parse_tests
from tests._dataset_formats import APPS_CALLS, DATASET_FORMATS, LCB_FUNCTIONAL, LINES, TACO_LEETCODE
from tests._reward_exploits import response
from tests._sandboxes_helpers import needs_bwrap, no_processes_left

TIMEOUT_S = 5.0


@functools.cache
def scores(partial: bool) -> dict:
    async def main():
        pool = SandboxPool(
            LocalProvider(),
            SandboxSpec(timeout_s=120),
            min_warm=1,
            max_live=4,
            name="formats",
            rate_limiter=False,
        )
        await pool.start()
        try:
            return await asyncio.gather(
                *(
                    score_sample(
                        pool, response(prog), json.dumps(tests), partial=partial, timeout_s=TIMEOUT_S
                    )
                    for tests, prog, _, _ in DATASET_FORMATS.values()
                )
            )
        finally:
            await pool.close()

    out = asyncio.run(main())
    no_processes_left()
    return dict(zip(DATASET_FORMATS, out, strict=True))


@needs_bwrap
@pytest.mark.parametrize("partial", [False, True], ids=["all_or_nothing", "partial"])
def test_every_dataset_shape_scores_what_it_deserves(partial):
    got = scores(partial)
    wrong = {}
    for name, (_, _, whole, part) in DATASET_FORMATS.items():
        want, s = (part if partial else whole), got[name]
        if s.masked or not math.isclose(s.score, want):
            wrong[name] = (s.score, s.cause, s.why, "want", want)
    assert not wrong, wrong


@needs_bwrap
def test_both_frameworks_score_the_dataset_shapes_alike():
    """verl's ``compute_score`` and slime's ``batched_reward_func``, with partial credit, the
    label as each framework's dataset carries it (JSON text)."""
    from types import SimpleNamespace

    from modal_rl.sandboxes.shared import close_shared_pools
    from slime_modal.config import close_rollout_pools
    from slime_modal.reward import batched_reward_func
    from verl_modal.reward import compute_score

    items = list(DATASET_FORMATS.values())

    async def verl():
        try:
            outs = await asyncio.gather(
                *(
                    compute_score(
                        "code",
                        response(p),
                        json.dumps(t),
                        {},
                        exec_timeout_s=TIMEOUT_S,
                        partial=True,
                        backend="local",
                        max_live=4,
                    )
                    for t, p, _, _ in items
                )
            )
        finally:
            await close_shared_pools()
        return [o["score"] for o in outs]

    async def slime():
        args = SimpleNamespace(modal_rl_reward={"timeout_s": TIMEOUT_S, "partial": True})
        samples = [
            SimpleNamespace(
                index=i, response=response(p), label=json.dumps(t), metadata={}, remove_sample=False
            )
            for i, (t, p, _, _) in enumerate(items)
        ]
        try:
            out = await batched_reward_func(args, samples)
        finally:
            await close_rollout_pools()
        assert not any(s.remove_sample for s in samples)
        return out

    want = [part for _, _, _, part in items]
    got_verl = asyncio.run(verl())
    got_slime = asyncio.run(slime())
    no_processes_left()
    assert all(map(math.isclose, got_verl, want)), list(zip(DATASET_FORMATS, got_verl, want, strict=True))
    assert got_slime == got_verl


def test_list_of_lines_are_joined_as_lines():
    spec = parse_tests(LINES)
    assert spec.cases[0] == ("2\n3 4\n5 6\n", "7\n11\n")


def test_call_cases_become_one_assert_per_case_in_the_runner():
    spec = parse_tests(json.dumps(APPS_CALLS))
    assert spec.calls is not None and spec.code is None and not spec.cases
    code = call_test_code(spec.calls, "def count_vowels(s):\n    return 0\n")
    tree = ast.parse(code.code)
    asserts = [s for s in tree.body if isinstance(s, ast.Assert)]
    others = [s for s in tree.body if not isinstance(s, ast.Assert)]
    assert len(asserts) == 4 and code.entry_point == "count_vowels"
    # Every other statement is setup (no unit); the program is reached only through candidate.
    setup = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assign)
    assert all(isinstance(s, setup) for s in others), [ast.unparse(s)[:60] for s in others]
    assert all("candidate(" in ast.unparse(a) for a in asserts)
    # The cases ride as one JSON literal: the expected values appear once, not per line.
    assert code.code.count("hello") == 1


def test_leetcode_items_call_a_fresh_solution():
    spec = parse_tests(TACO_LEETCODE)
    code = call_test_code(spec.calls, "")  # the starter code alone says it is a Solution method
    assert "from solution import Solution" in code.code and code.entry_point is None
    assert code.code.count("Solution().maxProfit(") == 4
    lcb = parse_tests(LCB_FUNCTIONAL)
    assert lcb.calls.fn_name == "twoSum" and lcb.calls.cases[0] == ([[2, 7, 11, 15], 9], [0, 1])
    assert not lcb.calls.unwrap  # LiveCodeBench compares the return value exactly


@pytest.mark.parametrize(
    ("tests", "cause"),
    [
        ({"inputs": ["1"], "outputs": []}, "differ in length"),
        ({"fn_name": "f", "inputs": ["1"], "outputs": [1]}, "argument lists"),
        ({"fn_name": "not a name", "inputs": [[1]], "outputs": [1]}, "identifier"),
        ({"inputs": [{"a": 1}], "outputs": ["1"]}, "list of lines"),
        ([{"input": "1", "output": "1", "testtype": "functional"}], "function's name"),
        ({"public_test_cases": "[]", "private_test_cases": "eJy"}, "decode the compressed"),
        ({"inputs": [], "outputs": []}, "no test cases"),
    ],
)
def test_bad_shapes_are_one_line_naming_the_fix(tests, cause):
    with pytest.raises(ValueError, match=cause) as info:
        parse_tests(tests)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("out", "expected", "same"),
    [
        ("6\n", "6", True),
        ("  6  \r\n\n", "6\n", True),
        ("1 2\n3\n", "1  2\n3", True),
        ("0.3333333\n", "0.3333333333\n", True),
        ("1\n", "1.0\n", True),
        ("2.5000001 7\n", "2.5 7\n", True),
        ("0.33\n", "0.3333333333\n", False),
        ("100001\n", "100000\n", False),  # integers digit for digit
        ("6\n7\n", "6\n", False),
        ("6\n", "6\n7\n", False),
        ("1 2 3\n", "1 2\n", False),
        ("abc\n", "abd\n", False),
        ("nan\n", "0.5\n", False),
    ],
)
def test_the_stdout_rule(out, expected, same):
    assert same_output(out, expected) is same


def test_the_stdout_budget_is_twice_the_expected_plus_64k():
    assert stdout_budget("") == 64 << 10 and stdout_budget("ab") == 4 + (64 << 10)
