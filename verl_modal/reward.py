"""verl reward: async sandboxed test-case scoring, usable as ``custom_reward_function``.

    reward.custom_reward_function.path=<site-packages>/verl_modal/reward.py
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.backend=local

``ground_truth`` holds the test cases (see ``modal_rl.sandboxes.coderun.parse_tests``).
By name, the same scoring is verl's ``reward.reward_manager.name=modal_sandbox``
(``verl_modal.reward_manager``).

Scored by ``modal_rl.sandboxes.scoring.score_sample``, the path slime's reward uses too, and
returned as verl takes a score function's answer: a dict whose ``score`` is the reward and
whose other keys verl's reward managers put in ``reward_extra_info`` (one per sample, the same
keys for every sample):

- ``score`` (1.0/0.0, or the pass fraction with ``partial=True``), ``passed``, ``total``,
  ``execs`` (programs run in the sandbox), ``program_decides`` (checks the program's own
  methods decided);
- the mask: ``sandbox_masked`` (1 or 0, and verl's own invalid-sample key where the installed
  verl has one: ``verl_modal.sample_mask.reward_extra_info_flags``) and ``mask_cause``
  (``sandbox``, ``bad_tests``, ``internal``, or ``""``).

A masked sample is never a score: its ``score`` is a placeholder 0.0, and verl's agent loop (with
``verl_modal.sample_mask`` installed by our ``verl.plugins`` entry point, or verl's own seam)
takes it out of the loss; the group rule (``verl_modal.group_advantage``) keeps it out of its
siblings' advantages. It never raises for one sample's trouble.
"""

from __future__ import annotations

from typing import Any

from modal_rl.sandboxes.scoring import SampleScore, log_mask, score_sample
from modal_rl.sandboxes.shared import shared_pool
from verl_modal.sample_mask import CAUSE_KEY, reward_extra_info_flags

POOL_KEYS = ("backend", "image", "min_warm", "max_live", "memory_mb", "network", "app", "timeout_s", "cpu")
SCORE_KEYS = ("exec_timeout_s", "partial", "sandbox_retries")


def as_verl_result(result: SampleScore) -> dict:
    """``score_sample``'s answer as verl's score-function dict (module docstring)."""
    return {
        "score": result.score,
        "passed": result.passed,
        "total": result.total,
        "execs": result.execs,
        "program_decides": result.program_decides,
        CAUSE_KEY: (result.cause or "") if result.masked else "",
        **reward_extra_info_flags(result.masked),
    }


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    exec_timeout_s: float = 10.0,
    partial: bool = False,
    sandbox_retries: int = 2,
    **kwargs: Any,
) -> dict:
    settings = {k: kwargs[k] for k in POOL_KEYS if k in kwargs}
    result = await score_sample(
        lambda: shared_pool(**settings),
        solution_str,
        ground_truth,
        partial=partial,
        timeout_s=exec_timeout_s,
        sandbox_retries=sandbox_retries,
    )
    log_mask(result, (extra_info or {}).get("index", "?") if isinstance(extra_info, dict) else "?")
    return as_verl_result(result)
