"""Per-sample masking for verl 0.9.1: a masked sample is left out of the loss.

A sample is masked when its reward cannot be known (its sandbox failed, its tests were no
tests, our own error) or its engine died mid-request.

verl 0.9.1 has no per-sample mask a reward manager can set: a manager returns a score and a
``reward_extra_info`` dict, and a manager that raises fails the sample's whole GRPO group in
the agent loop. So the mask is two halves:

- our reward (``verl_modal.reward.compute_score``, alone as a ``custom_reward_function`` or
  inside the ``modal_sandbox`` manager, ``verl_modal.reward_manager``) answers a sample that
  ``score_sample`` masked (its sandbox failed after retries, its tests were no tests, or our
  own error) with ``reward_extra_info[MASK_KEY] = 1`` and the cause in
  ``reward_extra_info[CAUSE_KEY]`` (every other sample carries ``0`` and ``""``, so the keys
  agree across a batch); the ``modal_vllm`` replica flags a sample whose engine died
  mid-request with ``extra_fields[ENGINE_MASK_KEY]``;
- :func:`install` wraps verl's ``AgentLoopWorker._compute_score`` (the method that asks the
  reward worker and stores its answer on the trajectory) so that, on the V1 TransferQueue
  path (``AgentLoopWorkerTQ``, what ``main_ppo``'s V1 runner uses), a flagged trajectory gets
  ``response_mask`` all zeros and a group id (``uid``) of its own before it is written to
  the TransferQueue.

Why this excludes the sample rather than scoring it 0: every loss term verl computes (policy
loss, entropy, KL; ``loss_mask = response_mask``) is aggregated over ``response_mask``, so an
all-zero row adds nothing to numerator or denominator; and GRPO normalises rewards within a
``uid`` group, so a row moved to a group of its own does not shift its siblings' mean and
std (the same two moves verl's own batch padding makes for its synthetic rows,
``verl/trainer/ppo/padding_utils.py``). A sibling
left alone by masked rows is a group of one, which verl would train on its raw score: the group
rule (``verl_modal.group_advantage``) gives every row without a valid sibling advantage 0,
whatever uid the masked rows carry. Tested with verl's own advantage and loss functions.

On a verl whose V1 agent loop honours a reward result's own flag (the upstream seam
``patches/verl-main/0005``, key ``mask_sample``, seen by
:func:`verl_modal.upstream.invalid_sample_key`), the sandbox half needs no wrapper:
:func:`reward_extra_info_flags` adds verl's key next to ours and verl zeroes the sample's
response mask itself, keeping its uid; its GRPO then leaves the row out of the group's baseline
(a ``valid_mask`` read from the response mask), and the group rule does the same for every
estimator, so the advantages are those of the wrapper path. The wrapper stays for the engine flag (a replica's flag is not
a reward result) and for the legacy agent loop, which verl's seam does not cover.

Invariants: :func:`install` is idempotent and only wraps (the original always runs first);
the trajectory's TransferQueue key keeps its original uid, so verl's group bookkeeping is
unchanged; on the legacy (non-TQ) agent loop the response mask is already padded into the
batch when the score arrives, so a flagged sample raises ``SandboxError`` there instead (naming
the cause) - it is never scored.
"""

from __future__ import annotations

import functools
import sys
import uuid
from typing import Any

from modal_rl.sandboxes.errors import SandboxError

MASK_KEY = "sandbox_masked"
# Why a reward result masks its sample: score_sample's cause ("sandbox", "bad_tests",
# "internal"), "" for a scored sample.
CAUSE_KEY = "mask_cause"
# Set by the modal_vllm replica on a sample whose engine died mid-request (an empty, aborted
# response): verl already pads it to a zero response mask; the own group keeps its
# placeholder reward out of its siblings' GRPO statistics.
ENGINE_MASK_KEY = "modal_rl_masked"
TARGET = "verl.experimental.agent_loop.agent_loop"
TQ_MODULE = "verl.trainer.ppo.v1.agent_loop_tq"
MASKED_UID_PREFIX = "masked-"
_MARK = "__verl_modal_sample_mask__"


def reward_extra_info_flags(masked: bool) -> dict[str, int]:
    """The mask flags a reward result carries for one sample: ours, and verl's own key where
    the installed verl honours one (every sample carries them, so the batch's keys agree)."""
    from verl_modal import upstream

    flags = {MASK_KEY: int(masked)}
    verl_key = upstream.invalid_sample_key()
    if verl_key:
        flags[verl_key] = int(masked)
    return flags


def is_flagged(outputs: list[Any], sandbox: bool = True) -> bool:
    """True if the trajectory's final output carries the engine mask flag, or (``sandbox``)
    the sandbox one."""
    extra = outputs[-1].extra_fields or {}
    info = extra.get("reward_extra_info") or {}
    return bool((sandbox and info.get(MASK_KEY)) or extra.get(ENGINE_MASK_KEY))


def mask_cause(outputs: list[Any]) -> str | None:
    """Why the trajectory is left out of the loss: ``engine`` (its engine died mid-request),
    the reward's cause (``sandbox``, ``bad_tests``, ``internal``; ``sandbox`` from a reward
    result that flags without one), or None."""
    extra = outputs[-1].extra_fields or {}
    if extra.get(ENGINE_MASK_KEY):
        return "engine"
    info = extra.get("reward_extra_info") or {}
    return (info.get(CAUSE_KEY) or "sandbox") if info.get(MASK_KEY) else None


def mask_trajectory(outputs: list[Any], kwargs: dict) -> str:
    """Zero every output's response mask and give the trajectory a group of its own.

    ``kwargs`` is the dict verl's ``_agent_loop_postprocess`` later merges into each stored
    row, so the new ``uid`` reaches the advantage computation; returns that uid."""
    for out in outputs:
        out.response_mask = [0] * len(out.response_mask)
    kwargs["uid"] = f"{MASKED_UID_PREFIX}{uuid.uuid4().hex}"
    return kwargs["uid"]


def _on_tq_path(worker: Any) -> bool:
    return any(cls.__module__ == TQ_MODULE for cls in type(worker).__mro__)


def install() -> None:
    """Wrap ``AgentLoopWorker._compute_score`` in the loaded agent-loop module (idempotent)."""
    from verl_modal import upstream

    cls = sys.modules[TARGET].AgentLoopWorker
    original = cls._compute_score
    if getattr(original, _MARK, False):
        return
    # verl excludes a sample whose reward result flags it: only the engine flag is ours to act on
    sandbox = upstream.invalid_sample_key() is None

    @functools.wraps(original)
    async def _compute_score(self, outputs, kwargs):
        await original(self, outputs, kwargs=kwargs)
        cause = mask_cause(outputs) if outputs else None
        if cause:  # counted whoever excludes it (we, or verl's own seam): modal_rl.report.parts
            from modal_rl.report.parts import record_mask

            record_mask(cause)
        on_tq = _on_tq_path(self)  # verl's seam is on the TQ path only
        if not outputs or not is_flagged(outputs, sandbox=sandbox or not on_tq):
            return
        if not on_tq:
            raise SandboxError(
                f"a sample's reward is masked ({cause}); verl's legacy agent loop cannot mask it "
                "(use the V1 trainer, which masks it)"
            )
        mask_trajectory(outputs, kwargs)

    setattr(_compute_score, _MARK, True)
    cls._compute_score = _compute_score
