"""The CPU run's reward: the sandboxed test score plus a small shaping term.

    --custom-rm-path slime_modal.cpu.code_reward.reward_func

The test score is ``slime_modal.reward.reward_func``'s: the response's program run against the
prompt's test cases in a bubblewrap sandbox (1.0 when all pass). A random-weight model never
writes a passing program, so every sample of a group would score 0 and GRPO's advantages would
all be zero (nothing to learn, nothing to sync). The shaping term gives the group a spread:
``SHAPING`` times the share of the reference program's tokens (``metadata["solution"]``) that
appear in the response. It is computed here, from the response text, never from anything the
program does."""

from __future__ import annotations

import re
from typing import Any

from slime_modal.reward import reward_func as sandboxed

SHAPING = 0.1
_TOKEN = re.compile(r"\w+|[^\w\s]")


def shaping(response: str, solution: str) -> float:
    want = set(_TOKEN.findall(solution))
    if not want:
        return 0.0
    return len(want & set(_TOKEN.findall(response))) / len(want)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    score = await sandboxed(args, sample, **kwargs)
    meta = sample.metadata if isinstance(sample.metadata, dict) else {}
    return float(score) + SHAPING * shaping(sample.response or "", str(meta.get("solution", "")))
