"""verl reward: async sandboxed test-case scoring, usable as ``custom_reward_function``.

    reward.custom_reward_function.path=<site-packages>/verl_modal/reward.py
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.backend=local

``ground_truth`` holds the test cases (see ``modal_rl.sandboxes.coderun.parse_tests``).
Returns ``{"score": 1.0/0.0 (or the pass fraction with partial=True), "passed", "total",
"execs"}`` (``execs``: programs run in the sandbox). By name, the same scoring is verl's
``reward.reward_manager.name=modal_sandbox`` (``verl_modal.reward_manager``).

Sandbox failures never become a reward: a failed evaluation is retried with a fresh sandbox
(``sandbox_retries``), and if the infrastructure still fails the ``SandboxError`` propagates.
The ``modal_sandbox`` manager turns it into a masked sample (``verl_modal.sample_mask``); any
other manager fails the sample's group with it.
"""

from __future__ import annotations

from typing import Any

from modal_rl.sandboxes.coderun import extract_code, score_code
from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.shared import shared_pool

POOL_KEYS = ("backend", "image", "min_warm", "max_live", "memory_mb", "network", "app", "timeout_s", "cpu")
SCORE_KEYS = ("exec_timeout_s", "partial", "sandbox_retries")


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
    pool = await shared_pool(**{k: kwargs[k] for k in POOL_KEYS if k in kwargs})
    code = extract_code(solution_str)
    for attempt in range(sandbox_retries + 1):
        try:
            result = await score_code(
                pool, code, ground_truth, timeout_s=exec_timeout_s, stop_on_fail=not partial
            )
            break
        except SandboxError:
            if attempt == sandbox_retries:
                raise
    score = result.fraction if partial else float(result.all_passed)
    return {"score": score, "passed": result.passed, "total": result.total, "execs": result.execs}
