"""slime reward for ``--custom-rm-path slime_modal.reward.reward_func``: sandboxed test cases.

Reads the program from ``sample.response`` (last fenced block) and the tests from
``sample.label`` or ``sample.metadata["tests"]`` (formats: ``modal_rl.sandboxes.coderun``).
Score: 1.0 if every test passes, else 0.0 (``MODAL_RL_REWARD_PARTIAL=1``: the pass fraction).
Pool settings: ``MODAL_RL_SANDBOX_*`` environment variables (``modal_rl.sandboxes.shared``).

A sandbox that fails to start or dies masks the sample (``sample.remove_sample = True``, which
zeroes its loss mask in slime) instead of scoring it. Works for single samples and for the
batched call (a list of samples).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from modal_rl.sandboxes.coderun import extract_code, score_code
from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.shared import shared_pool

log = logging.getLogger(__name__)


async def _one(sample: Any) -> float:
    tests = sample.label if sample.label else (sample.metadata or {}).get("tests")
    if tests is None:
        raise ValueError(f"sample {sample.index}: no test cases in sample.label or sample.metadata['tests']")
    pool = await shared_pool()
    try:
        result = await score_code(
            pool,
            extract_code(sample.response),
            tests,
            timeout_s=float(os.environ.get("MODAL_RL_REWARD_TIMEOUT_S", "10")),
        )
    except SandboxError as exc:
        log.warning("sample %s masked: sandbox failure: %s", sample.index, exc)
        sample.remove_sample = True
        return 0.0  # carries no signal: the sample's loss mask is zeroed
    if os.environ.get("MODAL_RL_REWARD_PARTIAL") == "1":
        return result.fraction
    return float(result.all_passed)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
    if isinstance(sample, list):
        return list(await asyncio.gather(*(_one(s) for s in sample)))
    return await _one(sample)
