"""Sandboxed test-case scoring of model-written code: the logic behind both frameworks' rewards.

Test formats accepted (``parse_tests``, ``modal_rl.sandboxes.testformats``): stdin/stdout pairs
(APPS/TACO ``input_output``, lists of lines included; LiveCodeBench ``testtype: stdin``), call
cases (APPS/TACO ``fn_name``, LeetCode ``class Solution``; LiveCodeBench ``testtype:
functional``), and test code ``{"assert": "<python>"}`` (``"test"`` is the same key, HumanEval's
name), optionally with ``"entry_point"`` (the function HumanEval's ``check(candidate)`` gets).
Test code is any Python test file: plain asserts, ``check(candidate)``, raise-based checks,
``unittest`` and pytest files (``from solution import f``, classes, fixtures, parametrize).

The verdict never comes from anything the program can write, cause or read (the program is the
policy's, and the policy optimises against this reward):
- stdin/stdout cases: the host compares the captured output with the expected output, which
  never enters the sandbox (``stdio_compare``: the rule, and its bounds: at most 2x the
  expected size + 64 KiB of stdout ever reaches the host, a tail of stderr, and the comparison
  runs line by line, off the event loop when large);
- call cases and test code: a trusted runner runs the tests (call cases made test code on the
  host, expected values inside it), with the program as a remote module in a process that
  cannot reach the runner (``modal_rl.sandboxes.testrun``); the runner's report is the
  verdict. The exit code counts for nothing.

``score_code`` returns a score for everything the program can cause (a crash, a hang, killed
processes, exhausted memory or pids, flooded output, an early exit: a failure) and raises
``SandboxError`` only for what it cannot (no sandbox could be started, the sandbox was lost
from outside, the provider failed, the sandbox cannot isolate the program): the caller masks
that sample. Every exec runs in a PID namespace of its own (local provider), so nothing of one
test case survives into the next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from modal_rl.sandboxes import stdio_compare, testrun
from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.testformats import Tests, call_test_code, parse_tests

__all__ = ["CodeScore", "Tests", "extract_code", "parse_tests", "score_code"]

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block of a response, or the whole text if there is none."""
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else (text or "")


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
    if spec.calls is not None:
        spec = call_test_code(spec.calls, code)
    async with pool.lease() as sb:
        if spec.code is not None:
            return await _run_test_code(sb, code, spec, timeout_s)
        await sb.write_file("solution.py", code)
        score = CodeScore(0, len(spec.cases))
        for stdin, expected in spec.cases:
            if sb.remaining_s() < timeout_s + 5.0:  # the sandbox's lifetime would end mid-case
                score.details.append({"ok": False, "why": "sandbox lifetime spent by earlier cases"})
                break
            r = await sb.exec(
                ["python3", "solution.py"],
                timeout_s=timeout_s,
                stdin=stdin,
                stdout_limit_bytes=stdio_compare.stdout_budget(expected),
                stderr_tail_bytes=stdio_compare.STDERR_TAIL_BYTES,
            )
            score.execs += 1
            ok = r.ok and not r.stdout_truncated and await stdio_compare.compare(r.stdout, expected)
            score.passed += ok
            detail = {"rc": r.returncode, "timed_out": r.timed_out, "ok": ok}
            if r.stdout_truncated:
                detail["why"] = "stdout exceeds 2x the expected output + 64 KiB"
            score.details.append(detail)
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
    r = await sb.exec(
        testrun.local_runner_argv(),
        timeout_s=timeout_s,
        stdin=stdin,
        stderr_tail_bytes=stdio_compare.STDERR_TAIL_BYTES,  # the verdict is on stdout alone
    )
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
