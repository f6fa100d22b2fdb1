"""A sample's tests, in the shapes public code datasets publish them, made one ``Tests`` spec.

Accepted (``parse_tests``; a JSON string of any of these too):
- test code: ``{"assert"|"test": <python>, "entry_point"?: name, "prelude"?: <python>}``
  (HumanEval, MBPP, unittest, pytest files);
- APPS/TACO ``input_output``: ``{"inputs": [...], "outputs": [...]}``, or the whole record
  (``{"input_output": <that, or its JSON>, "starter_code"?: ...}``). Without ``fn_name`` every
  pair is a stdin/stdout case; an input or output that is a list is a list of lines, joined with
  newlines. With ``"fn_name"`` the cases are calls: each input is the argument list, each output
  the return value, or the return value wrapped in a one-element list (APPS's checker accepts
  both, and so do we);
- a list of ``{"input", "output"}`` cases, LiveCodeBench's with ``"testtype"``: ``"stdin"`` cases
  are stdin/stdout cases, ``"functional"`` ones are calls, the input one JSON value per line
  (the arguments), the output one JSON value. Functional cases need the function's name: pass
  the LiveCodeBench record (``{"public_test_cases", "private_test_cases"?, "metadata":
  {"func_name"}, "starter_code"?}``, the case lists as lists or their JSON) or ``{"test_cases":
  [...], "fn_name": name}``.

Invariants:
- expected values never enter the program's process: stdin/stdout cases are compared on the
  host (``stdio_compare``); call cases become test code (``call_test_code``) that the trusted
  runner runs, calling the program through ``candidate`` (the entry point) or, for LeetCode
  items, ``from solution import Solution``, and comparing in the runner with a helper the test
  itself defines (``_modal_rl_same``: plain data only, never a method of the program's);
- each call case is one top-level statement of that code, so one unit of the runner's report;
  the cases ride in it as a single JSON literal, decoded once;
- any other shape, or a shape with bad parts, is a ``ValueError``: one line naming the fix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from modal_rl.sandboxes import testrun

MAX_CASES = testrun.MAX_UNITS
_DEFINES_SOLUTION = re.compile(r"^class[ \t]+Solution\b", re.MULTILINE)


@dataclass(frozen=True)
class CallCases:
    """Call-based cases: ``fn_name(*args)`` must return ``want`` for each ``(args, want)``.
    ``unwrap``: a one-element list ``want`` also accepts its element (APPS/TACO's convention);
    ``starter`` is the dataset's starter code (says whether ``fn_name`` is a ``Solution`` method)."""

    fn_name: str
    cases: list[tuple[list, Any]]
    unwrap: bool
    starter: str | None = None


@dataclass(frozen=True)
class Tests:
    """A sample's tests: stdin/stdout ``cases``, test ``code`` (with its ``entry_point``), or
    ``calls`` (made test code once the program is known: ``call_test_code``)."""

    cases: list[tuple[str, str]] = field(default_factory=list)
    code: str | None = None
    entry_point: str | None = None
    prelude: str | None = None  # trusted code the tests build on (see testrun.payload)
    calls: CallCases | None = None


def _json(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{what} must be JSON, got {value[:80]!r}") from exc


def _text(value: Any, what: str) -> str:
    """A stdin or expected-stdout value as text; a list is a list of lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return "".join(f"{v}\n" for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{what} must be text or a list of lines, got {type(value).__name__}: fix the dataset")


def _name(value: Any) -> str:
    if not (isinstance(value, str) and value.isidentifier()):
        raise ValueError(f"the function name must be a Python identifier, got {value!r}")
    return value


def _bounded(cases: list) -> list:
    if not cases:
        raise ValueError("the sample has no test cases: give at least one input/output pair")
    if len(cases) > MAX_CASES:
        raise ValueError(f"{len(cases)} test cases: at most {MAX_CASES} per sample; split the sample")
    return cases


def _apps(io: dict, starter: Any) -> Tests:
    inputs, outputs = io["inputs"], io["outputs"]
    if not (isinstance(inputs, list) and isinstance(outputs, list)):
        raise ValueError("'inputs' and 'outputs' must be lists (one entry per case)")
    if len(inputs) != len(outputs):
        raise ValueError("test cases: 'inputs' and 'outputs' differ in length")
    fn_name = io.get("fn_name")
    if fn_name in (None, ""):
        pairs = zip(inputs, outputs, strict=True)
        return Tests(cases=_bounded([(_text(i, "an input"), _text(o, "an output")) for i, o in pairs]))
    if not all(isinstance(args, list) for args in inputs):
        raise ValueError("call-based ('fn_name') inputs must be argument lists, e.g. [[1, 2], [3, 4]]")
    starter = starter if isinstance(starter, str) else None
    cases = _bounded(list(zip(inputs, outputs, strict=True)))
    return Tests(calls=CallCases(_name(fn_name), cases, unwrap=True, starter=starter))


def _lcb_args(text: Any) -> list:
    if not isinstance(text, str):
        raise ValueError("a functional case's input must be text: one JSON value per line")
    return [_json(line, "a functional case's input line") for line in text.split("\n") if line.strip()]


def _case_list(cases: list, fn_name: Any, starter: Any) -> Tests:
    """``[{"input", "output", "testtype"?}, ...]``: all stdin, or all functional."""
    kinds = {str(c.get("testtype", "stdin")) for c in cases}
    if kinds <= {"stdin"}:
        return Tests(
            cases=_bounded([(_text(c["input"], "an input"), _text(c["output"], "an output")) for c in cases])
        )
    if kinds != {"functional"}:
        raise ValueError(f"test cases mix test types {sorted(kinds)}: one sample is stdin or functional")
    if fn_name is None:
        raise ValueError(
            "functional test cases need the function's name: pass {'test_cases': [...], 'fn_name': name} "
            "or the LiveCodeBench record with its metadata"
        )
    calls = [(_lcb_args(c["input"]), _json(c["output"], "a functional case's output")) for c in cases]
    starter = starter if isinstance(starter, str) else None
    return Tests(calls=CallCases(_name(fn_name), _bounded(calls), unwrap=False, starter=starter))


def _is_case_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, dict) and "input" in t and "output" in t for t in value
    )


def _livecodebench(record: dict) -> Tests:
    cases: list = []
    for key in ("public_test_cases", "private_test_cases"):
        part = record.get(key)
        if part in (None, "", []):
            continue
        if isinstance(part, str):
            try:
                part = json.loads(part)
            except ValueError:
                raise ValueError(
                    f"LiveCodeBench {key} is not JSON: decode the compressed cases (base64, zlib, "
                    "pickle) into a JSON list before scoring"
                ) from None
        if not _is_case_list(part):
            raise ValueError(f"LiveCodeBench {key} must be a list of {{'input', 'output', 'testtype'}}")
        cases += part
    metadata = _json(record.get("metadata") or {}, "LiveCodeBench metadata")
    fn_name = record.get("fn_name") or (metadata.get("func_name") if isinstance(metadata, dict) else None)
    return _case_list(cases, fn_name, record.get("starter_code"))


def _code(tests: dict) -> Tests:
    code = tests.get("assert", tests.get("test"))
    entry = tests.get("entry_point")
    prelude = tests.get("prelude")
    if not isinstance(code, str) or not (entry is None or isinstance(entry, str)):
        raise ValueError("test code must be a string, and 'entry_point' a function name")
    if not (prelude is None or isinstance(prelude, str)):
        raise ValueError("'prelude' must be Python source (the dataset's trusted helpers)")
    testrun.check_test_code(code)
    if prelude:
        testrun.check_test_code(prelude)
    return Tests(code=code, entry_point=entry, prelude=prelude or None)


def parse_tests(tests: Any) -> Tests:
    """Normalise a sample's tests; ``ValueError`` (one line, naming the fix) for any other shape."""
    tests = _json(tests, "test cases")
    if isinstance(tests, dict) and ("assert" in tests or "test" in tests):
        return _code(tests)
    if isinstance(tests, dict) and "input_output" in tests:
        io = _json(tests["input_output"], "'input_output'")
        if not (isinstance(io, dict) and "inputs" in io and "outputs" in io):
            raise ValueError("'input_output' must hold {'inputs': [...], 'outputs': [...]}")
        return _apps(io, tests.get("starter_code"))
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        return _apps(tests, tests.get("starter_code"))
    if isinstance(tests, dict) and ("public_test_cases" in tests or "private_test_cases" in tests):
        return _livecodebench(tests)
    if isinstance(tests, dict) and _is_case_list(tests.get("test_cases")):
        return _case_list(tests["test_cases"], tests.get("fn_name"), tests.get("starter_code"))
    if _is_case_list(tests):
        return _case_list(tests, None, None)
    raise ValueError(
        "test cases must be {'inputs': [...], 'outputs': [...], 'fn_name'?: name}, "
        "[{'input', 'output', 'testtype'?}, ...] or {'assert': code, 'entry_point'?: name}"
    )


# The test's own comparison, defined by the generated test (so never a name of the program's):
# plain data by value, containers walked alongside the expected value (so no deeper than it),
# tuples as lists (JSON has none), numbers with a float among them within 1e-6 (as the host's
# stdin/stdout rule). Anything else, a program object included, does not match.
_HELPERS = """import math as _modal_rl_math
import json as _modal_rl_json


def _modal_rl_eq(got, want):
    tg, tw = type(got), type(want)
    if issubclass(tg, (list, tuple)) and tw is list:
        return len(got) == len(want) and all(_modal_rl_eq(g, w) for g, w in zip(list(got), want))
    if issubclass(tg, dict) and tw is dict:
        keys = list(dict.keys(got))
        return len(keys) == len(want) and all(
            type(k) is str and k in want and _modal_rl_eq(dict.__getitem__(got, k), want[k]) for k in keys
        )
    if tg is bool or tw is bool or got is None or want is None:
        return tg in (bool, int, type(None)) and got == want
    if issubclass(tg, (int, float)) and tw in (int, float):
        if tg is float or tw is float:
            return _modal_rl_math.isclose(float(got), want, rel_tol=1e-6, abs_tol=1e-6)
        return int(got) == want
    if issubclass(tg, str) and tw is str:
        return str.__eq__(str(got), want)
    return False


def _modal_rl_same(got, want, unwrap):
    if _modal_rl_eq(got, want):
        return True
    return unwrap and type(want) is list and len(want) == 1 and _modal_rl_eq(got, want[0])
"""


def uses_solution_class(calls: CallCases, program: str) -> bool:
    """LeetCode-style items call ``Solution().fn_name``: the starter code says so, or the
    program defines ``class Solution`` at top level (a wrong guess only fails the program)."""
    return "class Solution" in (calls.starter or "") or bool(_DEFINES_SOLUTION.search(program))


def call_test_code(calls: CallCases, program: str) -> Tests:
    """The call cases as a test script for the trusted runner: one assert per case."""
    data = json.dumps([[args, want] for args, want in calls.cases], separators=(",", ":"))
    lines = [_HELPERS, f"_modal_rl_cases = _modal_rl_json.loads({data!r})"]
    if uses_solution_class(calls, program):
        lines.append("from solution import Solution")
        call, entry = f"Solution().{calls.fn_name}", None
    else:
        call, entry = "candidate", calls.fn_name
    unwrap = "True" if calls.unwrap else "False"
    for i in range(len(calls.cases)):
        lines.append(
            f"assert _modal_rl_same({call}(*_modal_rl_cases[{i}][0]), _modal_rl_cases[{i}][1], {unwrap})"
        )
    return Tests(code="\n".join(lines) + "\n", entry_point=entry)
