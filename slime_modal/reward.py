"""slime rewards that run the model's program against test cases in sandboxes.

    --custom-rm-path slime_modal.reward.reward_func                        # one sample per call
    --group-rm --custom-rm-path slime_modal.reward.batched_reward_func     # a list per call

The program is the last fenced code block of ``sample.response`` (the whole response if there
is none). The test cases are ``sample.metadata["tests"]`` if present, else ``sample.label``:

- a test spec (``modal_rl.sandboxes.coderun``): JSON text or an object, ``{"inputs": [...],
  "outputs": [...]}``, ``[{"input": ..., "output": ...}]`` or ``{"assert": "<python>"}``;
- any other text (not a JSON object or list) is the expected standard output of the program run
  with empty standard input (one test case).

Scored by ``modal_rl.sandboxes.scoring.score_sample``, the path verl's reward uses too: 1.0 if
every test passes, else 0.0; with ``modal_rl_reward.partial`` (custom config) or
``MODAL_RL_REWARD_PARTIAL=1``, the fraction passed over all tests. A sample with no tests (or
tests that are no test spec), and a sample whose sandbox fails to start or dies, is masked
(``sample.remove_sample = True``, which zeroes its loss mask in slime; the reason is logged) and
scores 0.0, which then carries no signal; the other samples of a batch keep their scores.
Pool settings: ``slime_modal.config``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from modal_rl.report.parts import record_sandbox
from modal_rl.sandboxes.scoring import score_sample
from modal_rl.sandboxes.shared import on_pool_loop
from slime_modal.config import reward_settings, rollout_pool

log = logging.getLogger(__name__)
# This process's scoring counters, for the run's numbers (modal_rl.report.parts.record_sandbox).
_COUNTS = {"samples": 0, "execs": 0, "sandbox_errors": 0}


def sample_tests(sample: Any) -> Any:
    """The test cases of ``sample`` in a form ``coderun.parse_tests`` accepts."""
    meta = sample.metadata if isinstance(sample.metadata, dict) else {}
    if meta.get("tests") is not None:
        return meta["tests"]
    label = sample.label
    if label is None or label == "":
        raise ValueError(f"sample {sample.index}: no test cases in sample.metadata['tests'] or sample.label")
    if not isinstance(label, str):
        return label
    try:
        spec = json.loads(label)
    except ValueError:
        spec = None
    if isinstance(spec, dict | list):
        return spec
    return [{"input": "", "output": label}]  # plain text: the expected stdout


async def _score(args: Any, sample: Any) -> float:
    timeout_s, partial = reward_settings(args)
    try:
        tests = sample_tests(sample)
    except ValueError as exc:
        log.error("sample %s masked: %s", sample.index, exc)
        sample.remove_sample = True
        return 0.0

    async def run() -> Any:  # on the pool's loop: sandbox I/O never lives on the caller's loop
        result = await score_sample(
            lambda: rollout_pool(args), sample.response, tests, partial=partial, timeout_s=timeout_s
        )
        _COUNTS["samples"] += 1
        _COUNTS["execs"] += result.execs
        _COUNTS["sandbox_errors"] += int(result.masked and result.cause == "sandbox")
        record_sandbox(dict(_COUNTS), (await rollout_pool(args)).snapshot())
        return result

    result = await on_pool_loop(run())
    if result.masked:  # a dataset problem is an error to fix; a sandbox failure is weather
        (log.error if result.cause == "bad_tests" else log.warning)(
            "sample %s masked: %s", sample.index, result.why
        )
        sample.remove_sample = True
        return 0.0
    return result.score


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """Score one sample (slime's ``async_rm``)."""
    if isinstance(sample, list):
        raise TypeError(
            "reward_func scores one sample; with --group-rm use slime_modal.reward.batched_reward_func"
        )
    return await _score(args, sample)


async def batched_reward_func(args: Any, samples: list[Any], **kwargs: Any) -> list[float]:
    """Score a list of samples concurrently (slime's ``batched_async_rm``, ``--group-rm``)."""
    if not isinstance(samples, list):
        raise TypeError("batched_reward_func takes a list of samples; for one sample use reward_func")
    return list(await asyncio.gather(*(_score(args, s) for s in samples)))
