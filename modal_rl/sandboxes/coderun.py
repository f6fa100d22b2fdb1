"""Sandboxed test-case scoring of model-written code: the logic behind both frameworks' rewards.

Test formats accepted (``parse_tests``): a JSON string or object ``{"inputs": [...], "outputs":
[...]}`` (stdin/stdout pairs), a list of ``{"input": ..., "output": ...}``, or
``{"assert": "<python test code>"}``. Output comparison ignores trailing whitespace per line.

The verdict never comes from anything the program can write, cause or read (the program is the
policy's, and the policy optimises against this reward):
- stdin/stdout cases: the host compares the captured output with the expected output, which
  never enters the sandbox;
- assert tests: ``modal_rl.sandboxes.verdict`` splits each assert; only the calls into the
  program run in the sandbox (``_harness``), their values come back strictly encoded and the
  host compares them with the expected side. The exit code counts for nothing.

``score_code`` returns a score for everything the program can cause (a crash, a hang, killed
processes, exhausted memory or pids, flooded output, an early exit: a failure) and raises
``SandboxError`` only for what it cannot (no sandbox could be started, the sandbox was lost
from outside, the provider failed): the caller masks that sample. Every exec runs in a PID
namespace of its own (local provider), so nothing of one test case survives into the next.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modal_rl.sandboxes import verdict
from modal_rl.sandboxes.pool import SandboxPool

_HARNESS_SRC = (Path(__file__).with_name("_harness.py")).read_text()

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block of a response, or the whole text if there is none."""
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else (text or "")


def parse_tests(tests: Any) -> tuple[list[tuple[str, str]], str | None]:
    """Normalise test cases to ([(stdin, expected_stdout)], assert_code)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise ValueError(f"test cases must be JSON, got {tests[:80]!r}") from exc
    if isinstance(tests, dict) and "assert" in tests:
        return [], str(tests["assert"])
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("test cases: 'inputs' and 'outputs' differ in length")
        return [(str(i), str(o)) for i, o in zip(tests["inputs"], tests["outputs"], strict=True)], None
    if isinstance(tests, list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return [(str(t["input"]), str(t["output"])) for t in tests], None
    raise ValueError(
        "test cases must be {'inputs': [...], 'outputs': [...]}, [{'input', 'output'}, ...] or {'assert': code}"
    )


def _same(out: str, expected: str) -> bool:
    norm = lambda s: [ln.rstrip() for ln in s.strip().splitlines()]  # noqa: E731
    return norm(out) == norm(expected)


@dataclass
class CodeScore:
    passed: int
    total: int
    details: list[dict] = field(default_factory=list)
    unsplit: int = 0  # asserts judged inside the sandbox (see ``verdict``), counted in total
    execs: int = 0  # programs run in the sandbox

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
    cases, assert_code = parse_tests(tests)
    plan = verdict.plan_asserts(assert_code) if assert_code is not None else None
    async with pool.lease() as sb:
        if plan is not None:
            # One exec: the harness reads the program and the steps on stdin; no file to tamper with.
            r = await sb.exec(["python3", "-c", _HARNESS_SRC], timeout_s=timeout_s, stdin=plan.payload(code))
            checks = verdict.judge(plan, r.stdout)
            for row in checks:
                row.update(rc=r.returncode, timed_out=r.timed_out)
            score = CodeScore(sum(c["ok"] for c in checks), len(checks), checks)
            score.unsplit, score.execs = sum(not c["split"] for c in checks), 1
            if checks and not score.all_passed:
                score.details[-1]["stderr"] = r.stderr[-500:]
            return score
        await sb.write_file("solution.py", code)
        score = CodeScore(0, len(cases))
        for stdin, expected in cases:
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
