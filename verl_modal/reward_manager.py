"""verl reward manager ``modal_sandbox``: sandboxed test-case scoring, selected by name.

    reward.reward_manager.name=modal_sandbox
    +reward.reward_kwargs.backend=local        # optional: sandbox pool settings and
    +reward.reward_kwargs.exec_timeout_s=10    # verl_modal.reward.compute_score options
    +reward.reward_kwargs.metrics_dir=DIR      # optional: write sandbox counters here

It is verl's ``naive`` per-sample flow (decode the response, call the score function) with
``verl_modal.reward.compute_score`` as the score function, bound to ``reward.reward_kwargs``
(where verl's own ``dapo`` manager reads its options). An explicit
``reward.custom_reward_function`` still wins, as with every verl manager.

Registered into verl's reward-loop registry by ``verl_modal._sandbox_register`` when
``verl.experimental.reward_loop.reward_manager`` loads; importing this module imports that
registry (and so torch and transformers), which is why ``import verl`` does not import it.

Invariants:
- unknown ``reward_kwargs`` are an error when the manager is built, not at the first sample;
- a masked sample is never a score: ``compute_score`` answers it with
  ``reward_extra_info["sandbox_masked"] = 1`` and its cause in ``mask_cause`` (every scored
  sample carries ``0`` and ``""``), counted in ``sandbox_errors`` (cause ``sandbox``) or
  ``masked_other`` (``bad_tests``, ``internal``); ``verl_modal.sample_mask`` then takes it out
  of the loss and ``verl_modal.group_advantage`` out of its siblings' advantages. The
  ``reward_score`` of a masked sample is a placeholder that no loss term reads. An explicit
  ``custom_reward_function`` that raises ``SandboxError`` is masked the same way;
- with a metrics dir, ``sandbox-reward-<pid>.json`` there is rewritten atomically after every
  sample: ``samples`` (scored), ``execs`` (programs run), ``sandbox_errors``, ``masked_other``
  and the pool's snapshot.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.experimental.reward_loop.reward_manager.registry import register

from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.scoring import SampleScore, log_mask
from modal_rl.sandboxes.shared import shared_pool
from verl_modal import reward as sandbox_reward
from verl_modal.sample_mask import CAUSE_KEY, MASK_KEY, reward_extra_info_flags

NAME = "modal_sandbox"
METRICS_ENV = "MODAL_RL_SANDBOX_METRICS_DIR"
OPTION_KEYS = (*sandbox_reward.POOL_KEYS, *sandbox_reward.SCORE_KEYS)


def reward_options(config) -> tuple[dict, str | None]:
    """(score-function kwargs, metrics dir) from ``config.reward.reward_kwargs``."""
    options = dict(config.reward.get("reward_kwargs") or {})
    metrics_dir = options.pop("metrics_dir", None) or os.environ.get(METRICS_ENV) or None
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(
            f"reward manager {NAME!r}: unknown reward.reward_kwargs {unknown}; "
            f"known: {sorted([*OPTION_KEYS, 'metrics_dir'])}"
        )
    return options, metrics_dir


@register(NAME)
class SandboxRewardManager(NaiveRewardManager):
    """Per-sample scoring in single-use sandboxes from the process's shared pool."""

    def __init__(
        self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None
    ):
        options, self.metrics_dir = reward_options(config)
        self.pool_settings = {k: v for k, v in options.items() if k in sandbox_reward.POOL_KEYS}
        custom = (config.reward.get("custom_reward_function") or {}).get("path")
        if not custom:  # verl passed its data-source dispatcher, which knows no code task
            compute_score = functools.partial(sandbox_reward.compute_score, **options)
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        self.counts = {"samples": 0, "execs": 0, "sandbox_errors": 0, "masked_other": 0}

    async def run_single(self, data) -> dict:
        try:
            out = await super().run_single(data)
        except SandboxError as exc:
            self.counts["sandbox_errors"] += 1
            await self._write_metrics()
            return masked_result(exc)
        info = out["reward_extra_info"]
        for key, value in reward_extra_info_flags(False).items():  # a custom function's result
            info.setdefault(key, value)
        if info[MASK_KEY]:
            self.counts["sandbox_errors" if info.get(CAUSE_KEY) == "sandbox" else "masked_other"] += 1
        else:
            self.counts["samples"] += 1
        self.counts["execs"] += int(info.get("execs", 0))
        await self._write_metrics()
        return out

    async def _write_metrics(self) -> None:
        if not self.metrics_dir:
            return
        pool = await shared_pool(**self.pool_settings)
        snapshot = {**self.counts, "pid": os.getpid(), "pool": pool.snapshot()}
        path = Path(self.metrics_dir) / f"sandbox-reward-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot, default=str))
        tmp.replace(path)


def masked_result(exc: BaseException) -> dict:
    """The answer for a sample whose score function raised ``SandboxError``: flagged for the
    mask, with the keys ``compute_score`` gives every sample."""
    result = SampleScore(0.0, masked=True, cause="sandbox", why=f"sandbox failure: {exc}"[:300])
    log_mask(result, "?")
    return {"reward_score": 0.0, "reward_extra_info": sandbox_reward.as_verl_result(result)}
