"""One scoring path for every framework: a sample's response and tests in, a score or a mask out.

``score_sample`` is what ``verl_modal.reward`` (``compute_score``, the ``modal_sandbox`` reward
manager) and ``slime_modal.reward`` (``reward_func``, ``batched_reward_func``) call, so both
frameworks score the same sample identically:
- the program is the last fenced code block of the response (``coderun.extract_code``);
- the tests are a test spec (``coderun.parse_tests``), or its JSON text; any other non-empty
  text is the expected standard output of the program run with empty standard input (one
  case: :func:`test_spec`), so a dataset's plain answer field means the same in both frameworks;
- ``partial``: the fraction of test units passed, over *all* of them (stdin/stdout cases are
  all run); otherwise 1.0 only if every unit passed;
- a sandbox failure (``SandboxError``: none could be started, it was lost from outside, it
  cannot isolate the program) is retried on a fresh sandbox ``sandbox_retries`` times, then the
  sample is **masked** (``cause="sandbox"``): never a score, since the program did not cause it;
- tests that are not a test spec mask the sample with ``cause="bad_tests"`` and a one-line
  reason (a dataset problem: no program can pass or fail them);
- it never raises for one sample's trouble, so a batch scored with ``asyncio.gather`` keeps
  every other sample's score; an unexpected error is logged with its traceback and masks
  (``cause="internal"``);
- ``program_decides``: how many of the sample's checks rested on the program's own methods
  (``==`` of two program objects, a program ``__bool__``), as the test runner counted them;
  reported per sample by both adapters, never changing the score.

Each adapter hands this result to its framework in the framework's own way, with the same mask
causes: verl's ``compute_score`` returns it as the score dict (mask flags and ``mask_cause``
included), slime's ``reward_func`` sets ``remove_sample`` and keeps it in
``sample.metadata["modal_rl_reward"]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from modal_rl.sandboxes.coderun import extract_code, parse_tests, score_code
from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.pool import SandboxPool

log = logging.getLogger("modal_rl.sandboxes")


@dataclass(frozen=True)
class SampleScore:
    score: float
    passed: int = 0
    total: int = 0
    execs: int = 0
    masked: bool = False
    cause: str | None = None  # masked: "sandbox", "bad_tests" or "internal"
    why: str | None = None  # masked: one line
    program_decides: int = 0  # checks the program's own methods decided (never scored differently)

    def as_dict(self) -> dict:
        return asdict(self)


def test_spec(tests: Any) -> Any:
    """A dataset's test field as ``parse_tests`` takes it (module docstring); text that is not a
    JSON object or list becomes one stdin/stdout case. Anything else is returned as is."""
    if not isinstance(tests, str) or not tests.strip():
        return tests
    try:
        spec = json.loads(tests)
    except ValueError:
        spec = None
    return spec if isinstance(spec, dict | list) else [{"input": "", "output": tests}]


def log_mask(result: SampleScore, sample: object) -> None:
    """Say why ``sample`` is masked: a dataset problem (``bad_tests``) at ERROR, an error to fix;
    a sandbox failure (or our own) at WARNING, weather. Nothing for a scored sample."""
    if result.masked:
        level = logging.ERROR if result.cause == "bad_tests" else logging.WARNING
        log.log(level, "sample %s masked (%s): %s", sample, result.cause, result.why)


def _masked(cause: str, why: str) -> SampleScore:
    return SampleScore(0.0, masked=True, cause=cause, why=why[:300])


async def score_sample(
    pool: SandboxPool | Callable[[], Awaitable[SandboxPool]],
    response: str,
    tests: Any,
    *,
    partial: bool = False,
    timeout_s: float = 10.0,
    sandbox_retries: int = 2,
) -> SampleScore:
    """Score one sample. ``pool`` is a pool, or an async callable returning one (a shared pool
    made on first use). Never raises for the sample's own trouble (see the module docstring)."""
    tests = test_spec(tests)
    try:
        parse_tests(tests)
    except ValueError as exc:
        return _masked("bad_tests", f"bad test cases: {exc}")
    code = extract_code(response)
    try:
        pool = pool if isinstance(pool, SandboxPool) else await pool()
        for attempt in range(sandbox_retries + 1):
            try:
                result = await score_code(pool, code, tests, timeout_s=timeout_s, stop_on_fail=not partial)
                break
            except SandboxError as exc:
                if attempt == sandbox_retries:
                    return _masked("sandbox", f"sandbox failure: {exc}")
    except SandboxError as exc:
        return _masked("sandbox", f"sandbox failure: {exc}")
    except ValueError as exc:  # the tests ran and turned out to hold no check
        return _masked("bad_tests", f"bad test cases: {exc}")
    except Exception as exc:  # a bug of ours: never lose the batch for it
        log.exception("scoring a sample failed")
        return _masked("internal", f"internal error while scoring: {type(exc).__name__}: {exc}")
    score = result.fraction if partial else float(result.all_passed)
    decides = int(getattr(result, "program_decides", 0) or 0)
    return SampleScore(score, result.passed, result.total, result.execs, program_decides=decides)
