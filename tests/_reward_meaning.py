"""The remote module keeps Python's meaning: test shapes of public code datasets that only work
when values cross by value, program objects keep their protocol, exceptions keep their class and
message, callbacks run in the runner, and names are bound by declaration; and the exploits that
bind the program's names into the tests, cross control flow, or count units by syntax.

Each entry: ``(tests, program, all_or_nothing, partial)``; a score of ``None`` means the sample is
masked as ``bad_tests`` (the tests cannot judge any program)."""

from __future__ import annotations

LIST_NODE = "class ListNode:\n    def __init__(self, val=0, next=None):\n        self.val = val\n        self.next = next\n"
LEETCODE_PRELUDE = (
    LIST_NODE
    + "def make(xs):\n    h = None\n    for x in reversed(xs):\n        h = ListNode(x, h)\n    return h\n"
    "def is_same_list(a, b):\n    while a and b:\n        if a.val != b.val:\n            return False\n"
    "        a, b = a.next, b.next\n    return a is None and b is None\n"
)
REVERSE = "def rev(h):\n    p = None\n    while h:\n        h.next, p, h = p, h, h.next\n    return p\n"
CYCLIC_PROMPT = (
    "def encode_cyclic(s: str):\n    groups = [s[(3 * i):min((3 * i + 3), len(s))] for i in range((len(s) + 2) // 3)]\n"
    "    groups = [(g[1:] + g[0]) if len(g) == 3 else g for g in groups]\n    return ''.join(groups)\n\n\n"
    "def decode_cyclic(s: str):\n    '''takes as input string encoded with encode_cyclic function.'''\n"
)
CYCLIC_TEST = (
    "def check(candidate):\n    for s in ['abcdefg', 'xyz', 'hello world']:\n"
    "        assert candidate(encode_cyclic(s)) == s\n"
)
VECTOR = (
    "class Vector:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
    "    def __add__(self, o):\n        return Vector(self.x + o.x, self.y + o.y)\n"
    "    def __eq__(self, o):\n        return isinstance(o, Vector) and (self.x, self.y) == (o.x, o.y)\n"
    "    def __repr__(self):\n        return f'Vector({self.x}, {self.y})'\n"
)

HONEST = {
    # MBPP's reference solutions return Counters; the tests compare them with dicts
    "counter_result": (
        {"assert": "assert freq('aab') == {'a': 2, 'b': 1}\nassert freq('') == {}\n"},
        "from collections import Counter\ndef freq(s):\n    return Counter(s)\n",
    ),
    "filter_and_generator_results": (
        {"assert": "assert list(evens([1, 2, 4])) == [2, 4]\nassert sum(squares(3)) == 5\n"},
        "def evens(xs):\n    return filter(lambda x: x % 2 == 0, xs)\ndef squares(n):\n    return (i * i for i in range(n))\n",
    ),
    "datetime_arguments": (
        {"assert": "import datetime\nassert nxt(datetime.date(2020, 2, 28)) == datetime.date(2020, 2, 29)\n"},
        "import datetime\ndef nxt(d):\n    return d + datetime.timedelta(days=1)\n",
    ),
    "listnode_built_by_the_test": (
        {
            "assert": "a = make([1, 2, 3])\nassert is_same_list(rev(a), make([3, 2, 1]))\n",
            "prelude": LEETCODE_PRELUDE,
        },
        REVERSE,
    ),
    "nodes_come_back_as_the_same_objects": (
        {
            "assert": LIST_NODE
            + "a = ListNode(1, ListNode(2))\nr = rev(a)\nassert r.next is a and a.next is None\n"
        },
        LIST_NODE + REVERSE,
    ),
    "coroutine_under_asyncio_run": (
        {"assert": "import asyncio\nassert asyncio.run(inc(1)) == 2\n"},
        "import asyncio\nasync def inc(x):\n    await asyncio.sleep(0)\n    return x + 1\n",
    ),
    "functions_passed_in": (
        {
            "assert": "@twice\ndef inc(x):\n    return x + 1\nassert inc(1) == 3\nassert apply(lambda v: v * 2, [1, 2]) == [2, 4]\n"
        },
        "def twice(fn):\n    def w(*a):\n        return fn(fn(*a))\n    return w\ndef apply(f, xs):\n    return [f(x) for x in xs]\n",
    ),
    "iterator_class": (
        {"assert": "assert list(Countdown(3)) == [3, 2, 1]\nit = Countdown(1)\nassert next(it) == 1\n"},
        "class Countdown:\n    def __init__(self, n):\n        self.n = n\n    def __iter__(self):\n        return self\n"
        "    def __next__(self):\n        if self.n <= 0:\n            raise StopIteration\n        self.n -= 1\n        return self.n + 1\n",
    ),
    "item_access_and_context_manager": (
        {
            "assert": "g = Grid()\ng[1, 2] = 5\nassert g[1, 2] == 5 and len(g) == 1\nwith Res() as r:\n    assert r.open\n"
        },
        "class Grid:\n    def __init__(self):\n        self.d = {}\n    def __setitem__(self, k, v):\n        self.d[k] = v\n"
        "    def __getitem__(self, k):\n        return self.d[k]\n    def __len__(self):\n        return len(self.d)\n"
        "class Res:\n    def __enter__(self):\n        self.open = True\n        return self\n    def __exit__(self, *a):\n        return False\n",
    ),
    "operators_and_repr": (
        {
            "assert": "assert Vector(1, 2) + Vector(3, 4) == Vector(4, 6)\nassert repr(Vector(1, 2)) == 'Vector(1, 2)'\n"
        },
        VECTOR,
    ),
    "class_constants_and_factories": (
        {
            "assert": "assert Color.RED == 'red'\nassert Point.origin().x == 0\nassert Point.dist(Point(1, 1), Point(2, 3)) == 3\n"
        },
        "class Color:\n    RED = 'red'\nclass Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    @classmethod\n    def origin(cls):\n        return cls(0, 0)\n    @staticmethod\n"
        "    def dist(a, b):\n        return abs(a.x - b.x) + abs(a.y - b.y)\n",
    ),
    "test_subclasses_a_program_class": (
        {
            "assert": "from solution import Animal\nclass Loud(Animal):\n    def speak(self):\n        return super().speak().upper()\n"
            "assert Loud('rex').speak() == 'REX SPEAKS'\n"
        },
        "class Animal:\n    def __init__(self, n):\n        self.n = n\n    def speak(self):\n        return self.n + ' speaks'\n",
    ),
    "pytest_raises_the_programs_exception": (
        {
            "assert": "import pytest\nfrom solution import Account, InsufficientFunds\n\ndef test_w():\n"
            "    with pytest.raises(InsufficientFunds, match='no money'):\n        Account().withdraw(5)\n"
        },
        "class InsufficientFunds(ValueError):\n    pass\nclass Account:\n    def withdraw(self, x):\n"
        "        raise InsufficientFunds('no money')\n",
    ),
    "exception_message_and_args": (
        {
            "assert": "try:\n    f({})\nexcept KeyError as e:\n    assert e.args == ('k',)\nelse:\n    raise AssertionError\n"
            "try:\n    g()\nexcept ValueError as e:\n    assert str(e) == 'bad value 7'\n"
        },
        "def f(d):\n    return d['k']\ndef g():\n    raise ValueError('bad value 7')\n",
    ),
    "capsys_and_monkeypatched_input": (
        {
            "assert": "def test_hello(capsys):\n    hello()\n    assert capsys.readouterr().out == 'hi\\n'\n\n"
            "def test_ask(monkeypatch):\n    monkeypatch.setattr('builtins.input', lambda *a: '4')\n    assert ask() == 8\n"
        },
        "def hello():\n    print('hi')\ndef ask():\n    return int(input()) * 2\n",
    ),
    "pytest_warns_and_doctest": (
        {
            "assert": "import warnings\nimport pytest\n\ndef test_warns():\n    with pytest.warns(DeprecationWarning, match='old'):\n"
            "        assert old() == 1\n\ndef test_doctest():\n    '''\n    >>> old()\n    1\n    '''\n"
        },
        "import warnings\ndef old():\n    warnings.warn('old', DeprecationWarning)\n    return 1\n",
    ),
    "in_place_for_keyword_arguments": (
        {"assert": "x = [3, 1, 2]\nsort_it(a=x)\nassert x == [1, 2, 3]\n"},
        "def sort_it(a=None):\n    a.sort()\n",
    ),
    "wire_limits_real_tests_reach": (
        {
            "assert": "import math\nassert fact(2000) == math.factorial(2000)\nxs = list(range(300000, 0, -1))\n"
            "assert srt(xs) == sorted(xs)\nassert depth(trie(['a' * 81])) == 81\n"
        },
        "def fact(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r\ndef srt(xs):\n    return sorted(xs)\n"
        "def trie(ws):\n    root = {}\n    for w in ws:\n        n = root\n        for c in w:\n            n = n.setdefault(c, {})\n    return root\n"
        "def depth(t):\n    d = 0\n    while t:\n        t = next(iter(t.values()))\n        d += 1\n    return d\n",
    ),
    "numpy_in_an_evalplus_style_test": (
        {
            "assert": "import numpy as np\nassert np.allclose(mean([1.0, 2.0]), 1.5)\nassert np.array_equal(arange(3), np.arange(3))\n"
        },
        "import numpy as np\ndef mean(xs):\n    return np.mean(xs)\ndef arange(n):\n    return np.arange(n)\n",
    ),
    "script_with_a_test_case_helper": (
        {
            "assert": "def test_case(inp, want):\n    assert double(inp) == want\ntest_case(1, 2)\ntest_case(2, 4)\n"
        },
        "def double(x):\n    return x * 2\n",
    ),
    "import_pytest_with_module_level_asserts": (
        {"assert": "import pytest\nassert double(1) == 2\nassert double(2) == 4\n"},
        "def double(x):\n    return x * 2\n",
    ),
    "exhaustive_check_of_many_calls": (
        {"assert": "for i in range(10000):\n    assert inc(i) == i + 1\n"},
        "def inc(x):\n    return x + 1\n",
    ),
}

EXPLOITS = {
    "shadows_abs_for_an_mbpp_test": (
        {"assert": "assert abs(area(2) - 12.56) < 0.01\nassert abs(area(1) - 3.14) < 0.01\n"},
        "def abs(x):\n    return 0\ndef area(r):\n    return 0\n",
    ),
    "shadows_sorted_for_a_unittest": (
        {
            "assert": "import unittest\nclass T(unittest.TestCase):\n    def test_u(self):\n"
            "        self.assertEqual(sorted(uniq([3, 1, 3])), [1, 3])\n"
        },
        "def sorted(x, **k):\n    return [1, 3]\ndef uniq(x):\n    return x\n",
    ),
    "redefines_the_prompts_helper": (
        {"assert": CYCLIC_TEST, "entry_point": "decode_cyclic", "prelude": CYCLIC_PROMPT},
        "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n",
    ),
    "redefines_leetcodes_is_same_list": (
        {
            "assert": "assert is_same_list(rev(make([1, 2, 3])), make([3, 2, 1]))\n",
            "prelude": LEETCODE_PRELUDE,
        },
        "def is_same_list(a, b):\n    return True\ndef rev(h):\n    return h\n",
    ),
    "all_rebinds_a_module_the_test_imported": (
        {
            "assert": "import math\nfrom solution import *\n\ndef test_root():\n    assert root(9) == math.sqrt(9)\n"
        },
        "class _M:\n    @staticmethod\n    def sqrt(x):\n        return 0\nmath = _M()\ndef root(x):\n    return 0\n__all__ = ['math', 'root']\n",
    ),
    "stopiteration_ends_the_tests_iteration": (
        {
            "assert": "def check(candidate):\n    assert all(map(candidate, [1, 2, 3]))\n"
            "    for a, b in zip(map(candidate, [1]), [1]):\n        assert a == b\n",
            "entry_point": "f",
        },
        "def f(x):\n    raise StopIteration\n",
    ),
    "docstring_and_print_are_not_units": (
        {"assert": "'''Tests for f.'''\nassert f() == 1\nprint('All tests passed!')\n"},
        "def f():\n    return 0\n",
    ),
    "check_defined_and_never_called": (
        {"assert": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"},
        "def f(x):\n    return x\n",
    ),
    "a_function_defined_as_a_class": (
        {"assert": "assert greet('Bob').startswith('Hello')\nassert greet('Al').endswith('Al')\n"},
        "class greet:\n    def __init__(self, n):\n        pass\n    def startswith(self, x):\n        return True\n"
        "    def endswith(self, x):\n        return True\n",
    ),
    "returns_an_object_that_equals_everything": (
        {"assert": "assert f(1) == 2\nassert not (f(1) != 2)\n"},
        "class E:\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n        return False\ndef f(x):\n    return E()\n",
    ),
}

BAD_TESTS = {
    "patches_the_program_through_module_solution": (
        {
            "assert": "from unittest import mock\nwith mock.patch('solution.helper', return_value=5):\n    assert f() == 6\n"
        },
        "def helper():\n    return 1\ndef f():\n    return helper() + 1\n",
    ),
    "no_unit_at_all": (
        {"assert": "'''nothing to check'''\nprint('All tests passed!')\n"},
        "def f():\n    return 1\n",
    ),
    "imports_a_package_the_sandbox_lacks": (
        {"assert": "import not_a_real_package_xyz\nassert f() == 1\n"},
        "def f():\n    return 1\n",
    ),
}

PARTIAL = {
    "a_script_partly_right": (
        {
            "assert": "def test_case(inp, want):\n    assert double(inp) == want\ntest_case(1, 2)\ntest_case(2, 4)\ntest_case(3, 7)\n"
        },
        "def double(x):\n    return x * 2\n",
        0.0,
        2 / 3,
    ),
    "a_hanging_last_test_keeps_the_decided_units": (
        {
            "assert": "def test_1():\n    assert f(1) == 1\n\ndef test_2():\n    assert f(2) == 2\n\ndef test_3():\n    assert f(3) == 3\n"
        },
        "import time\ndef f(x):\n    if x == 3:\n        time.sleep(100)\n    return x\n",
        0.0,
        2 / 3,
    ),
}

CASES = {
    **PARTIAL,
    **{name: (tests, prog, 1.0, 1.0) for name, (tests, prog) in HONEST.items()},
    **{name: (tests, prog, 0.0, 0.0) for name, (tests, prog) in EXPLOITS.items()},
    **{name: (tests, prog, None, None) for name, (tests, prog) in BAD_TESTS.items()},
}
