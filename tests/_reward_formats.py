"""Real-world-shaped test files (our own problems, in the shapes of public code-RL sets), each
with a correct, a wrong and a partly right program and the score each deserves: (all-or-nothing,
partial credit). The shapes: HumanEval (``check(candidate)`` + ``entry_point``), MBPP (plain
asserts), APPS/CodeContests (stdin/stdout), LiveCodeBench functional (``class Solution``), a
design problem (a class the test drives), KodCode-style pytest (``from solution import``,
fixtures, ``pytest.raises``), ``unittest``, and the honest forms an assert splitter scored wrong.
"""

from __future__ import annotations

HUMANEVAL = {
    "test": "METADATA = {'author': 'modal-rl'}\n\n\ndef check(candidate):\n"
    "    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n    assert candidate([5]) == 5\n",
    "entry_point": "total",
}
MBPP = {
    "assert": "assert remove_vowels('hello') == 'hll'\nassert remove_vowels('AEIOU') == ''\n"
    "assert remove_vowels('xyz') == 'xyz'\nassert remove_vowels('Banana') == 'Bnn'\n"
}
APPS = {"inputs": ["3\n1 2 3\n", "1\n5\n", "2\n-1 1\n"], "outputs": ["6\n", "5\n", "0\n"]}
LIVECODEBENCH = {
    "assert": "assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]\n"
    "assert Solution().twoSum([3, 2, 4], 6) == [1, 2]\nassert Solution().twoSum([3, 3], 6) == [0, 1]\n"
}
DESIGN = {
    "assert": "c = Counter()\nc.inc()\nc.inc()\nassert c.value() == 2\nc.reset()\nassert c.value() == 0\n"
}
KODCODE = {
    "assert": "from solution import is_palindrome\n\n\ndef test_simple():\n    assert is_palindrome('racecar')\n\n\n"
    "def test_not():\n    assert not is_palindrome('abc')\n\n\ndef test_case():\n"
    "    assert is_palindrome('Racecar')\n\n\ndef test_empty():\n    assert is_palindrome('')\n"
}
PYTEST_FIXTURES = {
    "assert": "import pytest\nfrom solution import Stack, safe_div\n\n\n@pytest.fixture\ndef s():\n"
    "    st = Stack()\n    st.push(1)\n    return st\n\n\ndef test_pop(s):\n    assert s.pop() == 1\n\n\n"
    "def test_empty(s):\n    s.pop()\n    assert s.empty()\n\n\ndef test_div():\n    assert safe_div(6, 3) == 2\n\n\n"
    "def test_div_zero():\n    with pytest.raises(ZeroDivisionError):\n        safe_div(1, 0)\n"
}
UNITTEST = {
    "assert": "import unittest\n\n\nclass TestFizz(unittest.TestCase):\n"
    "    def test_fizz(self):\n        self.assertEqual(fizz(3), 'Fizz')\n\n"
    "    def test_buzz(self):\n        self.assertEqual(fizz(5), 'Buzz')\n\n"
    "    def test_fizzbuzz(self):\n        self.assertEqual(fizz(15), 'FizzBuzz')\n\n"
    "    def test_number(self):\n        self.assertEqual(fizz(7), '7')\n\n\n"
    "if __name__ == '__main__':\n    unittest.main()\n"
}
HELPER_ASSERTS = {
    "assert": "def helper(x, want):\n    assert double(x) == want\n\n\nhelper(1, 2)\nhelper(3, 6)\n"
}
MAIN_GUARD = {
    "assert": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(5) == 10\n\n\n"
    "if __name__ == '__main__':\n    check(double)\n"
}
IN_PLACE = {"assert": "nums = [3, 1, 2]\nsort_in_place(nums)\nassert nums == [1, 2, 3]\n"}

_FIZZ = "def fizz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n"
_FIZZ += "    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n"
_FIZZ_PART = (
    "def fizz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
)
_FIZZ_PART += "    return str(n)\n"
_TWOSUM = "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
_TWOSUM += "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
_TWOSUM += "                return [seen[target - x], i]\n            seen[x] = i\n"
_COUNTER = (
    "class Counter:\n    def __init__(self):\n        self.n = 0\n    def inc(self):\n        self.n += 1\n"
)
_COUNTER_PART = _COUNTER + "    def value(self):\n        return self.n\n    def reset(self):\n        pass\n"
_COUNTER += "    def value(self):\n        return self.n\n    def reset(self):\n        self.n = 0\n"
_STACK = "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
_STACK += "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
_STACK += "    def empty(self):\n        return not self.items\n"
_DIV = "def safe_div(a, b):\n    return a // b\n"
_IO = "n = int(input())\nprint(sum(map(int, input().split())))\n"
_IO_PART = "n = int(input())\nprint(sum(x for x in map(int, input().split()) if x > 0))\n"

# name: (tests, program, all-or-nothing score, partial-credit score)
FORMATS: dict[str, tuple[dict, str, float, float]] = {
    "humaneval_correct": (HUMANEVAL, "def total(xs):\n    return sum(xs)\n", 1.0, 1.0),
    "humaneval_wrong": (HUMANEVAL, "def total(xs):\n    return 0\n", 0.0, 0.0),
    "humaneval_partly": (HUMANEVAL, "def total(xs):\n    return sum(xs) if len(xs) < 2 else 0\n", 0.0, 0.0),
    "mbpp_correct": (
        MBPP,
        "def remove_vowels(s):\n    return ''.join(c for c in s if c.lower() not in 'aeiou')\n",
        1.0,
        1.0,
    ),
    "mbpp_wrong": (MBPP, "def remove_vowels(s):\n    return s\n", 0.0, 0.25),
    "mbpp_partly": (
        MBPP,
        "def remove_vowels(s):\n    return ''.join(c for c in s if c not in 'aeiou')\n",
        0.0,
        0.75,
    ),
    "apps_correct": (APPS, _IO, 1.0, 1.0),
    "apps_wrong": (APPS, "print(0)\n", 0.0, 1 / 3),
    "apps_partly": (APPS, _IO_PART, 0.0, 2 / 3),
    "livecodebench_correct": (LIVECODEBENCH, _TWOSUM, 1.0, 1.0),
    "livecodebench_wrong": (
        LIVECODEBENCH,
        "class Solution:\n    def twoSum(self, nums, target):\n        return []\n",
        0.0,
        0.0,
    ),
    "livecodebench_partly": (
        LIVECODEBENCH,
        "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n",
        0.0,
        2 / 3,
    ),
    "design_correct": (DESIGN, _COUNTER, 1.0, 1.0),
    "design_partly": (DESIGN, _COUNTER_PART, 0.0, 0.8),
    "kodcode_correct": (
        KODCODE,
        "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n",
        1.0,
        1.0,
    ),
    "kodcode_wrong": (KODCODE, "def is_palindrome(s):\n    return False\n", 0.0, 0.25),
    "kodcode_partly": (KODCODE, "def is_palindrome(s):\n    return s == s[::-1]\n", 0.0, 0.75),
    "pytest_fixtures_correct": (PYTEST_FIXTURES, _STACK + _DIV, 1.0, 1.0),
    "pytest_fixtures_partly": (
        PYTEST_FIXTURES,
        _STACK + "def safe_div(a, b):\n    return a // b if b else 0\n",
        0.0,
        0.75,
    ),
    "unittest_correct": (UNITTEST, _FIZZ, 1.0, 1.0),
    "unittest_wrong": (UNITTEST, "def fizz(n):\n    return ''\n", 0.0, 0.0),
    "unittest_partly": (UNITTEST, _FIZZ_PART, 0.0, 0.75),
    "helper_asserts_correct": (HELPER_ASSERTS, "def double(x):\n    return 2 * x\n", 1.0, 1.0),
    "helper_asserts_partly": (HELPER_ASSERTS, "def double(x):\n    return 2 if x == 1 else 0\n", 0.0, 0.5),
    "main_guard_correct": (MAIN_GUARD, "def double(x):\n    return 2 * x\n", 1.0, 1.0),
    "main_guard_wrong": (MAIN_GUARD, "def double(x):\n    return x\n", 0.0, 0.0),
    "in_place_correct": (IN_PLACE, "def sort_in_place(xs):\n    xs.sort()\n", 1.0, 1.0),
    "in_place_wrong": (IN_PLACE, "def sort_in_place(xs):\n    return sorted(xs)\n", 0.0, 0.5),
}
