"""Sandboxed test-case scoring of model-written code: the logic behind both frameworks' rewards.

Test formats accepted (``parse_tests``): a JSON string or object ``{"inputs": [...], "outputs":
[...]}`` (stdin/stdout pairs), a list of ``{"input": ..., "output": ...}``, or test code
``{"assert": "<python>"}`` (``"test"`` is the same key, HumanEval's name), optionally with
``"entry_point"`` (the function HumanEval's ``check(candidate)`` gets). Test code is any Python
test file: plain asserts, ``check(candidate)``, raise-based checks, ``unittest`` and pytest
files (``from solution import f``, classes, fixtures, parametrize).

The verdict never comes from anything the program can write, cause or read (the program is the
policy's, and the policy optimises against this reward):
- stdin/stdout cases: the host compares the captured output with the expected output, which
  never enters the sandbox; output comparison ignores trailing whitespace per line;
- test code: a trusted runner runs the tests unchanged, with the program as a remote module in
  a process that cannot reach the runner (``modal_rl.sandboxes.testrun``); the runner's report
  is the verdict. The exit code counts for nothing.

``score_code`` returns a score for everything the program can cause (a crash, a hang, killed
processes, exhausted memory or pids, flooded output, an early exit: a failure) and raises
``SandboxError`` only for what it cannot (no sandbox could be started, the sandbox was lost
from outside, the provider failed, the sandbox cannot isolate the program): the caller masks
that sample. Every exec runs in a PID namespace of its own (local provider), so nothing of one
test case survives into the next.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from modal_rl.sandboxes import testrun
from modal_rl.sandboxes.pool import SandboxPool

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block of a response, or the whole text if there is none."""
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else (text or "")


@dataclass(frozen=True)
class Tests:
    """A sample's tests: stdin/stdout ``cases``, or test ``code`` (with its ``entry_point``)."""

    cases: list[tuple[str, str]] = field(default_factory=list)
    code: str | None = None
    entry_point: str | None = None
    prelude: str | None = None  # trusted code the tests build on (see testrun.payload)


def parse_tests(tests: Any) -> Tests:
    """Normalise a sample's tests; ``ValueError`` (one line, naming the fix) for any other shape."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise ValueError(f"test cases must be JSON, got {tests[:80]!r}") from exc
    if isinstance(tests, dict) and ("assert" in tests or "test" in tests):
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
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("test cases: 'inputs' and 'outputs' differ in length")
        return Tests(cases=[(str(i), str(o)) for i, o in zip(tests["inputs"], tests["outputs"], strict=True)])
    if isinstance(tests, list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return Tests(cases=[(str(t["input"]), str(t["output"])) for t in tests])
    raise ValueError(
        "test cases must be {'inputs': [...], 'outputs': [...]}, [{'input', 'output'}, ...] or "
        "{'assert': code, 'entry_point'?: name}"
    )


def _same(out: str, expected: str) -> bool:
    norm = lambda s: [ln.rstrip() for ln in s.strip().splitlines()]  # noqa: E731
    return norm(out) == norm(expected)


@dataclass
class CodeScore:
    passed: int
    total: int
    details: list[dict] = field(default_factory=list)
    execs: int = 0  # programs run in the sandbox
    program_decides: int = 0  # verdicts that rested on the program's own methods (docs/sandboxes.md)

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


async def score_code(
    pool: SandboxPool, code: str, tests: Any, *, timeout_s: float = 10.0, stop_on_fail: bool = True
) -> CodeScore:
    """Run ``code`` against ``tests`` in one single-use sandbox from ``pool``."""
    spec = parse_tests(tests)
    async with pool.lease() as sb:
        if spec.code is not None:
            return await _run_test_code(sb, code, spec, timeout_s)
        await sb.write_file("solution.py", code)
        score = CodeScore(0, len(spec.cases))
        for stdin, expected in spec.cases:
            if sb.remaining_s() < timeout_s + 5.0:  # the sandbox's lifetime would end mid-case
                score.details.append({"ok": False, "why": "sandbox lifetime spent by earlier cases"})
                break
            r = await sb.exec(["python3", "solution.py"], timeout_s=timeout_s, stdin=stdin)
            score.execs += 1
            ok = r.ok and _same(r.stdout, expected)
            score.passed += ok
            score.details.append({"rc": r.returncode, "timed_out": r.timed_out, "ok": ok})
            if not ok and stop_on_fail:
                break
        return score


async def _run_test_code(sb: Any, code: str, spec: Tests, timeout_s: float) -> CodeScore:
    """One exec: the trusted runner, the program and the tests on its stdin (no file)."""
    try:
        stdin = testrun.payload(
            code, spec.code, spec.entry_point, testrun.deadline_for(timeout_s), prelude=spec.prelude
        )
    except UnicodeEncodeError:
        return CodeScore(0, 1, [{"ok": False, "why": "the program is not valid text"}], execs=0)
    r = await sb.exec(testrun.local_runner_argv(), timeout_s=timeout_s, stdin=stdin)
    report = testrun.parse_report(r.stdout)  # InfraUnavailable (a SandboxError) propagates
    if report.bad:
        raise ValueError(report.bad)
    details = [{"test": name, "ok": ok, **({"why": why} if why else {})} for name, ok, why in report.units]
    passed, total = report.counted()
    if not report.complete:
        why = "the test run was killed or hung before it finished" + (" (timed out)" if r.timed_out else "")
        details.append({"ok": False, "why": why})
    if report.note and details:
        details[0]["note"] = report.note
    return CodeScore(passed, total, details, execs=1, program_decides=report.decides)
