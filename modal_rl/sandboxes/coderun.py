"""Sandboxed test-case scoring of model-written code: the logic behind both frameworks' rewards.

Test formats accepted (``parse_tests``): a JSON string or object ``{"inputs": [...], "outputs":
[...]}`` (stdin/stdout pairs), a list of ``{"input": ..., "output": ...}``, or
``{"assert": "<python test code>"}`` appended to the program. Output comparison ignores
trailing whitespace per line.

``score_code`` raises ``SandboxError`` if the sandbox infrastructure fails: a wrong program
scores 0, a broken sandbox scores nothing (the caller masks the sample).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from modal_rl.sandboxes.pool import SandboxPool

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
    async with pool.lease() as sb:
        if assert_code is not None:
            await sb.write_file("solution.py", code + "\n\n" + assert_code + "\n")
            r = await sb.exec(["python3", "solution.py"], timeout_s=timeout_s)
            return CodeScore(
                int(r.ok), 1, [{"rc": r.returncode, "timed_out": r.timed_out, "stderr": r.stderr[-500:]}]
            )
        await sb.write_file("solution.py", code)
        score = CodeScore(0, len(cases))
        for stdin, expected in cases:
            r = await sb.exec(["python3", "solution.py"], timeout_s=timeout_s, stdin=stdin)
            ok = r.ok and _same(r.stdout, expected)
            score.passed += ok
            score.details.append({"rc": r.returncode, "timed_out": r.timed_out, "ok": ok})
            if not ok and stop_on_fail:
                break
        return score
