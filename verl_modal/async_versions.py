"""Keep a trajectory's first and last weight version across verl's partial-rollout client.

verl's ``FullyAsyncLLMServerClient.generate`` (the client of its separate-async and
fully-async trainers) resubmits an aborted request with the tokens so far and, at the end,
sets ``min_global_steps`` / ``max_global_steps`` from the ``global_steps`` field of its first
and last server answer: one number per answer. A ``modal_vllm`` answer knows more -- the
steps of the first and last version its tokens came from (``replica_proxy``, read from the
engine's ledger) -- and a request that saw a commit between two of its tokens is a single
answer spanning two versions. This wrapper collects every answer's own
``min_global_steps`` / ``max_global_steps`` while one partial-rollout ``generate`` runs (a
context variable, so concurrent trajectories on one event loop do not mix) and sets the
trajectory's fields to their minimum and maximum, so verl's staleness accounting
(``training/off_policy/trajectory_staleness*``, ``trajectory_spans``) sees the versions the
engine recorded.

Invariants: verl's methods run first and unchanged; a trajectory with no ``modal_vllm``
version record in any answer keeps verl's own fields; installing twice is a no-op.
"""

from __future__ import annotations

import contextvars
import functools
import sys

from verl_modal._register import after_import, loudly

TARGET = "verl.workers.rollout.llm_server"
_MARK = "__modal_rl_async_versions__"
_SPANS: contextvars.ContextVar[list | None] = contextvars.ContextVar("modal_rl_spans", default=None)


def span(spans: list[tuple[int, int]], fields: dict) -> dict:
    """``fields`` (a trajectory's ``extra_fields``) with the first and last version's steps of
    the answers in ``spans``; unchanged when there are none."""
    if not spans:
        return fields
    fields["min_global_steps"] = min(a for a, _ in spans)
    fields["max_global_steps"] = max(b for _, b in spans)
    return fields


def _one_answer(original):
    @functools.wraps(original)
    async def generate(self, *args, **kwargs):
        out = await original(self, *args, **kwargs)
        spans, extra = _SPANS.get(), getattr(out, "extra_fields", None) or {}
        if spans is not None and extra.get("modal_rl_versions") is not None:
            spans.append((int(extra["min_global_steps"]), int(extra["max_global_steps"])))
        return out

    setattr(generate, _MARK, True)
    return generate


def _trajectory(original):
    @functools.wraps(original)
    async def generate(self, *args, **kwargs):
        token = _SPANS.set([])
        try:
            out = await original(self, *args, **kwargs)
            span(_SPANS.get(), out.extra_fields)
            return out
        finally:
            _SPANS.reset(token)

    setattr(generate, _MARK, True)
    return generate


def patch(module) -> None:
    base, partial = module.LLMServerClient, module.FullyAsyncLLMServerClient
    if not getattr(base.generate, _MARK, False):
        base.generate = _one_answer(base.generate)
    if not getattr(partial.__dict__.get("generate"), _MARK, False):
        partial.generate = _trajectory(partial.generate)


def installed() -> bool:
    module = sys.modules.get(TARGET)
    return module is not None and getattr(module.FullyAsyncLLMServerClient.generate, _MARK, False)


after_import(TARGET, loudly("trajectory versions", lambda: patch(sys.modules[TARGET])))
