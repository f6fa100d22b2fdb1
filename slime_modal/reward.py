"""slime rewards that run the model's program against test cases in sandboxes.

    --custom-rm-path slime_modal.reward.reward_func                        # one sample per call
    --group-rm --custom-rm-path slime_modal.reward.batched_reward_func     # a list per call

The program is the last fenced code block of ``sample.response`` (the whole response if there
is none). The test cases are ``sample.metadata["tests"]`` if present, else ``sample.label``:

- a test spec (``modal_rl.sandboxes.coderun``): JSON text or an object, ``{"inputs": [...],
  "outputs": [...]}``, ``[{"input": ..., "output": ...}]`` or ``{"assert": "<python>"}``;
- any other text (not a JSON object or list) is the expected standard output of the program run
  with empty standard input (one test case).

Scored by ``modal_rl.sandboxes.scoring.score_sample``, the path verl's reward uses too, and
returned as slime takes a reward: 1.0 if every test passes, else 0.0; with
``modal_rl_reward.partial`` (custom config) or ``MODAL_RL_REWARD_PARTIAL=1``, the fraction
passed over all tests. A masked sample (``score_sample``'s causes: ``sandbox``, its sandbox
failed after retries; ``bad_tests``, no tests or tests that are no test spec; ``internal``, our
own error) gets ``sample.remove_sample = True``, which zeroes its loss mask in slime, scores
0.0 (a placeholder: ``slime_modal.reward_groups`` keeps it out of its siblings' group
statistics), and its cause is logged; the other samples of a batch keep their scores. Every
sample, scored or masked, carries ``score_sample``'s whole answer in ``sample.metadata["modal_rl_reward"]``
(``score``, ``passed``, ``total``, ``execs``, ``program_decides``, ``masked``, ``cause``,
``why``), the fields verl's ``compute_score`` returns.
Pool settings: ``slime_modal.config``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from modal_rl.report.parts import record_sandbox
from modal_rl.sandboxes.scoring import SampleScore, log_mask, score_sample
from modal_rl.sandboxes.shared import on_pool_loop
from slime_modal.config import reward_settings, rollout_pool

METADATA_KEY = "modal_rl_reward"
# This process's scoring counters, for the run's numbers (modal_rl.report.parts.record_sandbox).
_COUNTS = {"samples": 0, "execs": 0, "sandbox_errors": 0}


def sample_tests(sample: Any) -> Any:
    """The test cases of ``sample`` as ``score_sample`` takes them (``scoring.test_spec``)."""
    meta = sample.metadata if isinstance(sample.metadata, dict) else {}
    if meta.get("tests") is not None:
        return meta["tests"]
    label = sample.label
    if label is None or label == "":
        raise ValueError(f"sample {sample.index}: no test cases in sample.metadata['tests'] or sample.label")
    return label


async def _score(args: Any, sample: Any) -> float:
    timeout_s, partial = reward_settings(args)
    try:
        tests = sample_tests(sample)
    except ValueError as exc:
        result = SampleScore(0.0, masked=True, cause="bad_tests", why=str(exc)[:300])
    else:

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
    return as_slime_reward(result, sample)


def as_slime_reward(result: SampleScore, sample: Any) -> float:
    """``score_sample``'s answer on slime's ``sample`` (module docstring); returns the reward."""
    if isinstance(sample.metadata, dict):  # slime's Sample always has one
        sample.metadata[METADATA_KEY] = result.as_dict()
    if result.masked:
        log_mask(result, sample.index)
        sample.remove_sample = True
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
