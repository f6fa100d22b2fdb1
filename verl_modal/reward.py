"""verl reward: async sandboxed test-case scoring, usable as ``custom_reward_function``.

    reward.custom_reward_function.path=<site-packages>/verl_modal/reward.py
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.backend=local

``ground_truth`` holds the test cases (see ``modal_rl.sandboxes.coderun.parse_tests``).
Returns ``{"score": 1.0/0.0 (or the pass fraction with partial=True), "passed", "total",
"execs"}`` (``execs``: programs run in the sandbox). By name, the same scoring is verl's
``reward.reward_manager.name=modal_sandbox`` (``verl_modal.reward_manager``).

Scored by ``modal_rl.sandboxes.scoring.score_sample``, the path slime's reward uses too. Sandbox
failures never become a reward: a failed evaluation is retried with a fresh sandbox
(``sandbox_retries``), and if the infrastructure still fails a ``SandboxError`` is raised (tests
that are no test spec: a ``ValueError`` naming the problem).
The ``modal_sandbox`` manager turns it into a masked sample (``verl_modal.sample_mask``); any
other manager fails the sample's group with it.
"""

from __future__ import annotations

from typing import Any

from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.scoring import score_sample
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
    settings = {k: kwargs[k] for k in POOL_KEYS if k in kwargs}
    result = await score_sample(
        lambda: shared_pool(**settings),
        solution_str,
        ground_truth,
        partial=partial,
        timeout_s=exec_timeout_s,
        sandbox_retries=sandbox_retries,
    )
    if result.masked and result.cause == "bad_tests":
        raise ValueError(result.why)
    if result.masked:  # the modal_sandbox manager masks it; any other manager fails the group
        raise SandboxError(result.why)
    return {"score": result.score, "passed": result.passed, "total": result.total, "execs": result.execs}
