"""Tests in the shapes public code datasets publish them (our own problems), each with a right, a
wrong and a partly right program and the score each deserves (all-or-nothing, partial credit).

Shapes: APPS/TACO ``input_output`` stdin/stdout (the whole record, JSON-encoded as the datasets
ship it), its list-of-lines variant, a float answer, APPS call-based (``fn_name``), a TACO
LeetCode item (``class Solution`` starter code, outputs wrapped in a list), LiveCodeBench
stdin and functional records (``public_test_cases`` as JSON text, ``metadata`` with
``func_name``), and a functional case list named by ``fn_name``.
"""

from __future__ import annotations

import json

APPS_RECORD = {
    "input_output": json.dumps(
        {"inputs": ["3\n1 2 3\n", "1\n5\n", "2\n-1 1\n"], "outputs": ["6\n", "5\n", "0\n"]}
    ),
    "starter_code": "",
}
_SUM = "n = int(input())\nprint(sum(map(int, input().split())))\n"
_SUM_PART = "n = int(input())\nprint(sum(x for x in map(int, input().split()) if x > 0))\n"

# APPS keeps some inputs and outputs as lists of lines.
LINES = {"inputs": [["2", "3 4", "5 6"], ["1", "7 8"]], "outputs": [["7", "11"], ["15"]]}
_PAIRS = "for _ in range(int(input())):\n    print(sum(map(int, input().split())))\n"
_PAIRS_PART = (
    "for _ in range(int(input())):\n    a, b = map(int, input().split())\n    print(a + b if a < 7 else 0)\n"
)

# The expected outputs were printed with more digits than the program prints.
FLOATS = {"inputs": ["1 3\n", "2 3\n", "10 4\n"], "outputs": ["0.3333333333\n", "0.6666666667\n", "2.5\n"]}
_DIVIDE = "a, b = map(int, input().split())\nprint(f'{a / b:.7f}')\n"
_DIVIDE_PART = "a, b = map(int, input().split())\nprint(round(a / b, 1))\n"

APPS_CALLS = {
    "fn_name": "count_vowels",
    "inputs": [["hello"], ["sky"], ["AEIOU"], ["banana"]],
    "outputs": [[2], [0], [5], 3],
}
_VOWELS = "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n"
_VOWELS_PART = "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n"

TACO_LEETCODE = {
    "input_output": json.dumps(
        {
            "fn_name": "maxProfit",
            "inputs": [[[7, 1, 5, 3, 6, 4]], [[7, 6, 4, 3, 1]], [[1, 2]], [[2, 4, 1]]],
            "outputs": [[5], [0], [1], [2]],
        }
    ),
    "starter_code": "class Solution:\n    def maxProfit(self, prices: List[int]) -> int:\n        ",
}
_PROFIT = (
    "class Solution:\n    def maxProfit(self, prices):\n        best, low = 0, float('inf')\n"
    "        for p in prices:\n            low = min(low, p)\n            best = max(best, p - low)\n"
    "        return best\n"
)
_PROFIT_PART = (
    "class Solution:\n    def maxProfit(self, prices):\n        return max(0, prices[-1] - prices[0])\n"
)


def _lcb(cases: list[dict], func_name: str = "") -> dict:
    metadata = json.dumps({"func_name": func_name} if func_name else {})
    return {"public_test_cases": json.dumps(cases), "private_test_cases": "[]", "metadata": metadata}


LCB_STDIN = _lcb(
    [
        {"input": "abc\n", "output": "cba\n", "testtype": "stdin"},
        {"input": "x\n", "output": "x\n", "testtype": "stdin"},
        {"input": "hello\n", "output": "olleh\n", "testtype": "stdin"},
        {"input": "ab\n", "output": "ba\n", "testtype": "stdin"},
    ]
)
_REVERSE = "print(input()[::-1])\n"
_REVERSE_PART = "s = input()\nprint(s[::-1] if len(s) % 2 else s)\n"

LCB_FUNCTIONAL = _lcb(
    [
        {"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
        {"input": "[3,2,4]\n6", "output": "[1, 2]", "testtype": "functional"},
        {"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"},
    ],
    "twoSum",
)
_TWOSUM = (
    "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
    "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
    "                return [seen[target - x], i]\n            seen[x] = i\n"
)
_TWOSUM_PART = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"

FUNCTIONAL_LIST = {
    "fn_name": "mean",
    "test_cases": [
        {"input": "[1, 2]", "output": "1.5", "testtype": "functional"},
        {"input": "[1, 2, 3, 4]", "output": "2.5", "testtype": "functional"},
        {"input": "[10]", "output": "10.0", "testtype": "functional"},
    ],
}
_MEAN = "def mean(xs):\n    return sum(xs) / len(xs)\n"
_MEAN_PART = "def mean(xs):\n    return xs[0] / 1\n"

# Wrong programs that try the call path and the output bound: each deserves 0.0.
_ALWAYS_EQUAL = "class E:\n    def __eq__(self, other):\n        return True\n\n\n"
_SHADOW = "_modal_rl_same = lambda *a: True\n_modal_rl_eq = _modal_rl_same\n\n\n"
_PADDED = "s = input()\nprint(s[::-1])\nprint(' ' * 10_000_000)\n"

# name: (tests, program, all-or-nothing score, partial-credit score)
DATASET_FORMATS: dict[str, tuple[dict, str, float, float]] = {
    "apps_record_right": (APPS_RECORD, _SUM, 1.0, 1.0),
    "apps_record_wrong": (APPS_RECORD, "print(0)\n", 0.0, 1 / 3),
    "apps_record_partly": (APPS_RECORD, _SUM_PART, 0.0, 2 / 3),
    "lines_right": (LINES, _PAIRS, 1.0, 1.0),
    "lines_wrong": (LINES, "print(0)\n", 0.0, 0.0),
    "lines_partly": (LINES, _PAIRS_PART, 0.0, 0.5),
    "floats_right": (FLOATS, _DIVIDE, 1.0, 1.0),
    "floats_wrong": (FLOATS, "a, b = map(int, input().split())\nprint(b / a)\n", 0.0, 0.0),
    "floats_partly": (FLOATS, _DIVIDE_PART, 0.0, 1 / 3),
    "apps_calls_right": (APPS_CALLS, _VOWELS, 1.0, 1.0),
    "apps_calls_wrong": (APPS_CALLS, "def count_vowels(s):\n    return -1\n", 0.0, 0.0),
    "apps_calls_partly": (APPS_CALLS, _VOWELS_PART, 0.0, 0.75),
    "taco_leetcode_right": (TACO_LEETCODE, _PROFIT, 1.0, 1.0),
    "taco_leetcode_wrong": (
        TACO_LEETCODE,
        "class Solution:\n    def maxProfit(self, prices):\n        return -1\n",
        0.0,
        0.0,
    ),
    "taco_leetcode_partly": (TACO_LEETCODE, _PROFIT_PART, 0.0, 0.5),
    "lcb_stdin_right": (LCB_STDIN, _REVERSE, 1.0, 1.0),
    "lcb_stdin_wrong": (LCB_STDIN, "print(input())\n", 0.0, 0.25),
    "lcb_stdin_partly": (LCB_STDIN, _REVERSE_PART, 0.0, 0.75),
    "lcb_functional_right": (LCB_FUNCTIONAL, _TWOSUM, 1.0, 1.0),
    "lcb_functional_wrong": (
        LCB_FUNCTIONAL,
        "class Solution:\n    def twoSum(self, nums, target):\n        return []\n",
        0.0,
        0.0,
    ),
    "lcb_functional_partly": (LCB_FUNCTIONAL, _TWOSUM_PART, 0.0, 2 / 3),
    "functional_list_right": (FUNCTIONAL_LIST, _MEAN, 1.0, 1.0),
    "functional_list_wrong": (FUNCTIONAL_LIST, "def mean(xs):\n    return 0\n", 0.0, 0.0),
    "functional_list_partly": (FUNCTIONAL_LIST, _MEAN_PART, 0.0, 1 / 3),
    "apps_calls_always_equal": (
        APPS_CALLS,
        _ALWAYS_EQUAL + "def count_vowels(s):\n    return E()\n",
        0.0,
        0.0,
    ),
    "apps_calls_shadow_helpers": (APPS_CALLS, _SHADOW + "def count_vowels(s):\n    return -1\n", 0.0, 0.0),
    "taco_leetcode_always_equal": (
        TACO_LEETCODE,
        _ALWAYS_EQUAL + "class Solution:\n    def maxProfit(self, prices):\n        return E()\n",
        0.0,
        0.0,
    ),
    "lcb_stdin_padded_past_the_bound": (LCB_STDIN, _PADDED, 0.0, 0.0),
}
