"""The host side of the verdict (``modal_rl.sandboxes.verdict`` / ``hosteval``), without sandboxes:
what is split, what never enters the sandbox, and how results are judged."""

from __future__ import annotations

import json
import math

import pytest

from modal_rl.sandboxes import _harness, hosteval, verdict

EXPECTED = ["31337", "-4242", "'secret-answer'", "[9, 8, 7]"]


def _payload(test_code: str) -> tuple[verdict.AssertPlan, str]:
    plan = verdict.plan_asserts(test_code)
    return plan, plan.payload("def f(*a):\n    return a\n")


def _run_values(plan: verdict.AssertPlan, values: dict[int, object]) -> str:
    """The harness's results line for ``plan`` with the given value-step answers."""
    results = [{"ok": True}]
    for i, (kind, _) in enumerate(plan.steps):
        results.append({"value": _harness.encode(values[i])} if kind == "value" else {"ok": True})
    return _harness.MARK + json.dumps({"results": results}) + "\n"


@pytest.mark.parametrize(
    "test_code",
    [
        "assert f(1) == 31337\nassert -4242 == f(2)\nassert f('x') != 'secret-answer'\nassert f() == [9, 8, 7]",
        "def check(candidate):\n    assert candidate(1) == 31337\n    assert candidate(2) == -4242\n"
        "    assert candidate(3) == 'secret-answer'\n    assert candidate(4) == [9, 8, 7]\n\ncheck(f)\n",
        "def test_f():\n    assert f(1) == 31337\n    assert f(2) in (-4242, 0)\n\n"
        "def test_g():\n    assert f(3) == 'secret-answer' and f(4) == [9, 8, 7]\n",
        "for x, y in [(1, 31337), (2, -4242), (3, 'secret-answer'), (4, [9, 8, 7])]:\n    assert f(x) == y\n",
        "import math\nassert math.isclose(f(1), 31337, rel_tol=1e-9)\nassert abs(f(2) - -4242) < 1e-6\n"
        "assert sorted(f(3)) == ['secret-answer']\nassert len(f(4)) == len([9, 8, 7])\n",
    ],
)
def test_expected_values_never_enter_the_sandbox(test_code):
    plan, payload = _payload(test_code)
    assert plan.checks and all(c.split for c in plan.checks), [c.source for c in plan.checks if not c.split]
    sandbox_side = json.dumps(plan.steps)
    for value in EXPECTED:
        assert value not in sandbox_side and json.dumps(value)[1:-1] not in sandbox_side
    assert "candidate" not in sandbox_side and "check" not in sandbox_side


def test_split_asserts_are_judged_on_the_host():
    plan = verdict.plan_asserts(
        "assert f(1) == 3\nassert f(2) == (1, 2)\nassert not f(3)\nassert f(4) is None"
    )
    right = _run_values(plan, {0: 3, 1: (1, 2), 2: [], 3: None})
    assert [c["ok"] for c in verdict.judge(plan, right)] == [True] * 4
    wrong = _run_values(plan, {0: 3.5, 1: [1, 2], 2: [0], 3: 0})  # a list is not the tuple asked
    assert [c["ok"] for c in verdict.judge(plan, wrong)] == [False] * 4


def test_no_results_line_fails_every_assert():
    plan = verdict.plan_asserts("assert f(1) == 3\nassert g() == [1]")
    rows = verdict.judge(plan, "all tests passed\n")
    assert [r["ok"] for r in rows] == [False, False] and "no results" in rows[0]["why"]
    forged = _harness.MARK + json.dumps({"results": [{"ok": True}] * 3}) + "\n"
    assert not any(r["ok"] for r in verdict.judge(plan, forged))  # claims without values


def test_unsplit_asserts_run_in_the_sandbox_and_are_marked():
    code = "import numpy as np\nassert np.allclose(f(1), [1.0])\nassert f(1) == helper(2)\nassert f(3) == 4"
    plan = verdict.plan_asserts(code)
    assert [c.split for c in plan.checks] == [False, False, True]
    assert [k for k, _ in plan.steps] == ["exec", "check", "check", "value"]


def test_strict_encoding_refuses_what_the_program_defines():
    class Eq:
        def __eq__(self, other):
            return True

    class IntSub(int):
        pass

    for bad in (Eq(), IntSub(3), [1, Eq()], {"k": IntSub(1)}, object()):
        with pytest.raises(_harness.Refused):
            _harness.encode(bad)
    for good in (
        None,
        True,
        -(10**30),
        1.5,
        math.inf,
        2j,
        "s",
        b"\x00",
        [1, (2, {3}), {"a": frozenset({4})}],
    ):
        assert hosteval.decode(json.loads(json.dumps(_harness.encode(good)))) == good


@pytest.mark.parametrize("template", ["2 ** __v0", "[0] * __v0", "'ab' * __v0"])
def test_host_evaluation_bounds_what_a_value_can_cost(template):
    import ast

    with pytest.raises(ValueError, match="too large"):
        hosteval.host_eval(ast.parse(template, mode="eval").body, {"__v0": 10**9})


def test_test_code_that_does_not_parse_is_a_clear_error():
    with pytest.raises(ValueError, match="line 1"):
        verdict.plan_asserts("assert f(1) ==")
