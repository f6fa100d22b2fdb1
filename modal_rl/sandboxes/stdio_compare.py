"""How a program's stdout is judged against a stdin/stdout case's expected output, with bounds.

The rule (``same_output``), the tolerant core APPS/TACO's and LiveCodeBench's own checkers share:
- outputs are compared line by line (``\\n``-separated), after dropping leading and trailing
  blank lines and each line's trailing whitespace (``\\r`` included);
- a line that differs as text still matches when its whitespace-separated tokens pair up one to
  one and each pair is equal as text, or is a pair of numbers, at least one written with a
  fraction or an exponent, within ``FLOAT_TOL`` (``math.isclose`` with that relative *and*
  absolute tolerance). So ``0.333333`` matches ``0.3333333`` and ``1`` matches ``1.0`` (both
  checkers accept these), while two integers must be equal digit for digit (APPS's ``allclose``
  would let ``100000`` pass for ``100001``: we do not).

Bounds: the host never holds more of a program's stdout than ``stdout_budget(expected)`` bytes
(the exec is asked for no more: ``SandboxHandle.exec(stdout_limit_bytes=...)``); a program whose
output reaches the budget fails without being compared. The comparison walks both texts one line
at a time and stops at the first difference, and ``compare`` runs it in a worker thread when the
texts are large, so the event loop that schedules every other sample never waits on it.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from itertools import zip_longest

FLOAT_TOL = 1e-6
BUDGET_SLACK_BYTES = 64 << 10
STDERR_TAIL_BYTES = 8 << 10
# Below this many characters a comparison is cheaper than handing it to a thread.
INLINE_CHARS = 64 << 10
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def stdout_budget(expected: str) -> int:
    """The most stdout bytes a case's program may produce: 2x the expected output + 64 KiB."""
    return 2 * len(expected.encode("utf-8", "surrogatepass")) + BUDGET_SLACK_BYTES


def _lines(text: str) -> Iterator[str]:
    """``text``'s lines without trailing whitespace, leading and trailing blank lines dropped;
    one slice at a time (no list of every line)."""
    text = text.strip()
    start = 0
    while True:
        end = text.find("\n", start)
        if end < 0:
            yield text[start:].rstrip()
            return
        yield text[start:end].rstrip()
        start = end + 1


def _same_token(got: str, want: str) -> bool:
    if got == want:
        return True
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(want)):
        return False
    if not any(c in s for s in (got, want) for c in ".eE"):
        return False  # two integers: digit for digit
    a, b = float(got), float(want)
    return math.isclose(a, b, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)


def _same_line(got: str, want: str) -> bool:
    if got == want:
        return True
    a, b = got.split(), want.split()
    return len(a) == len(b) and all(_same_token(x, y) for x, y in zip(a, b, strict=True))


def same_output(out: str, expected: str) -> bool:
    """True when ``out`` matches ``expected`` under the rule in the module docstring."""
    return all(
        g is not None and w is not None and _same_line(g, w)
        for g, w in zip_longest(_lines(out), _lines(expected))
    )


async def compare(out: str, expected: str) -> bool:
    """``same_output``, off the event loop when either text is large."""
    if len(out) + len(expected) <= INLINE_CHARS:
        return same_output(out, expected)
    return await asyncio.to_thread(same_output, out, expected)
