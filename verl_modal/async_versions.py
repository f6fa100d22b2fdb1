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

The trajectory also gets its record in verl's steps (``extra_fields["modal_rl_versions"]``,
which verl's agent loop stores with the sample), and verl's v1 trainer's per-step metrics
(``PPOTrainer._compute_metrics``) gain the ``modal_rl/async/...`` numbers of the step's
samples (``modal_rl.asyncrl.metrics``: token-weighted staleness against the trainer's version
``global_steps - 1``, versions per sample, samples without a record, and verl's own sample
wait seconds of the step as the trainer wait, and the engines' idle seconds since the
step before as their ledgers count them: :func:`engine_idle`), so every tracker verl logs
to shows them.

verl's separation trainers (the one-step-off trainer, and the fully-async trainer, a Ray
actor built on the same base) log the same numbers from ``_fit_collect_metrics``, with
staleness in optimizer updates (``modal_rl.asyncrl.policy_age.UpdateClock``): the update
method counts updates, and the sync method publishes the label verl gave the weights (the
separation trainer's ``global_steps``; the fully-async trainer's ``current_param_version``,
from its own sync method).

Invariants: verl's methods run first and unchanged (a failure of ours is logged, never
raised); a trajectory with no ``modal_vllm``
version record in any answer keeps verl's own fields; installing twice is a no-op.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import sys

from verl_modal._register import after_import, loudly

TARGET = "verl.workers.rollout.llm_server"
METRICS_TARGET = "verl.trainer.ppo.v1.trainer_base"
SEPARATION_TARGET = "verl.experimental.separation.ray_trainer"  # one-step-off's trainer's base
FULLY_ASYNC_TARGET = "verl.experimental.fully_async_policy.fully_async_trainer"
VERSIONS = "modal_rl_versions"  # replica_proxy.VERSIONS
IDLE = "modal_rl_engine_idle"  # replica_proxy.IDLE
log = logging.getLogger("verl_modal")
_MARK = "__modal_rl_async_versions__"
_IDLE_SEEN = "_modal_rl_engine_idle_seen"  # on verl's trainer: each engine's largest idle counter
_CLOCK = "_modal_rl_update_clock"  # on a separation trainer: its updates and the labels' ages
_SPANS: contextvars.ContextVar[list | None] = contextvars.ContextVar("modal_rl_spans", default=None)


def span(spans: list[tuple], fields: dict) -> dict:
    """``fields`` (a trajectory's ``extra_fields``) with the first and last version's steps of
    the answers in ``spans`` (``(first, last, record, n_tokens, idle)`` each), when every
    answer has its record the trajectory's record (``VERSIONS``: the answers' records one
    after the other, a switch at each answer's first token whose step differs), and each
    engine's largest idle counter over the answers (``IDLE``); unchanged when there are none."""
    if not spans:
        return fields
    fields["min_global_steps"] = min(s[0] for s in spans)
    fields["max_global_steps"] = max(s[1] for s in spans)
    if all(isinstance(s[2], dict) and "tokens" in s[2] for s in spans):
        from modal_rl.asyncrl.versions import joined

        fields[VERSIONS] = joined([s[2] for s in spans])
    idle = largest_counters(s[4] for s in spans)
    if idle:
        fields[IDLE] = idle
    return fields


def _one_answer(original):
    @functools.wraps(original)
    async def generate(self, *args, **kwargs):
        out = await original(self, *args, **kwargs)
        spans, extra = _SPANS.get(), getattr(out, "extra_fields", None) or {}
        if spans is not None and extra.get(VERSIONS) is not None:
            first, last = int(extra["min_global_steps"]), int(extra["max_global_steps"])
            n_tokens = len(getattr(out, "token_ids", None) or [])
            spans.append((first, last, extra[VERSIONS], n_tokens, extra.get(IDLE)))
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


def largest_counters(counters) -> dict[str, float]:
    """Each engine's largest idle counter over ``counters`` (``{engine: seconds}`` each, or
    anything else, which carries none)."""
    out: dict[str, float] = {}
    for counter in counters:
        for engine, seconds in (counter if isinstance(counter, dict) else {}).items():
            out[engine] = max(float(seconds), out.get(engine, 0.0))
    return out


def engine_idle(extra_fields: list, seen: dict[str, float]) -> float | None:
    """Seconds the engines idled since the newest answer of the steps before, from the idle
    counters the step's samples carry (``IDLE``: per engine, its ledger's idle seconds when
    the answer was read; a replaced engine's new ledger is a new key). ``seen`` (each
    engine's largest counter so far) is updated in place, so the steps' numbers add up to
    each engine's idle time up to its newest answer read, and a step whose samples are all
    older than one of an earlier step adds 0. ``None`` when no sample carries a counter."""
    newest = largest_counters(extra.get(IDLE) if isinstance(extra, dict) else None for extra in extra_fields)
    if not newest:
        return None
    total = 0.0
    for engine, seconds in newest.items():
        before = seen.get(engine, 0.0)
        total += max(seconds - before, 0.0)
        seen[engine] = max(seconds, before)
    return total


def step_metrics(
    extra_fields: list,
    trainer_step: int,
    trainer_wait_s: float | None,
    engine_idle_s: float | None = None,
) -> dict[str, float]:
    """One training step's ``modal_rl/async/...`` numbers from its samples' ``extra_fields``
    (``trainer_step``: the version the trainer held, verl's ``global_steps - 1``)."""
    from modal_rl.asyncrl.metrics import step_numbers

    samples = [(versions, n, trainer_step) for versions, n in sample_records(extra_fields)]
    return step_numbers(samples, engine_idle_s=engine_idle_s, trainer_wait_s=trainer_wait_s)


def sample_records(extra_fields: list) -> list[tuple]:
    """``(SampleVersions or None, n_tokens)`` per sample from its ``extra_fields`` record
    (``None``, 0 tokens: no record, or one that breaks the version contract)."""
    from modal_rl.asyncrl.versions import SampleVersions, VersionContractError

    out = []
    for extra in extra_fields:
        rec = extra.get(VERSIONS) if isinstance(extra, dict) else None
        try:
            versions = SampleVersions(tuple(rec["versions"]), tuple(rec["switch_at"]))
            out.append((versions.check(max(int(rec["tokens"]), 1)), int(rec["tokens"])))
        except (TypeError, KeyError, VersionContractError):
            out.append((None, 0))
    return out


def _with_async_metrics(original, tq):
    @functools.wraps(original)
    def compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        out = original(self, batch, metrics, timing_raw, global_steps, epoch)
        try:
            real = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"]
            )
            extra = data.pop("extra_fields").tolist()
            wait = getattr(self, "_step_sample_wait_seconds", None)
            mine = [extra[i] for i in real]
            if any(isinstance(e, dict) and VERSIONS in e for e in mine):
                idle = engine_idle(mine, self.__dict__.setdefault(_IDLE_SEEN, {}))
                metrics.update(step_metrics(mine, int(global_steps) - 1, wait, idle))
        except Exception as exc:  # noqa: BLE001 -- our numbers never fail verl's step
            log.warning("modal_rl async metrics unavailable: %r", exc)
        return out

    setattr(compute_metrics, _MARK, True)
    return compute_metrics


def patch_metrics(module) -> None:
    trainer = module.PPOTrainer
    if not getattr(trainer._compute_metrics, _MARK, False):
        trainer._compute_metrics = _with_async_metrics(trainer._compute_metrics, module.tq)


def patch(module) -> None:
    base, partial = module.LLMServerClient, module.FullyAsyncLLMServerClient
    if not getattr(base.generate, _MARK, False):
        base.generate = _one_answer(base.generate)
    if not getattr(partial.__dict__.get("generate"), _MARK, False):
        partial.generate = _trajectory(partial.generate)


def _counting_updates(original):
    @functools.wraps(original)
    def update_actor(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _clock(self).updated()
        return out

    setattr(update_actor, _MARK, True)
    return update_actor


def _publishing(original):
    @functools.wraps(original)
    def fit_update_weights(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _clock(self).published(int(self.global_steps))  # the label verl's sync gave the weights
        return out

    setattr(fit_update_weights, _MARK, True)
    return fit_update_weights


def _publishing_versions(original):
    """A fully-async trainer's sync: verl counts its syncs in ``current_param_version`` (bumped
    after every ``trigger_parameter_sync_step``-th update, before the sync that carries it) and
    labels the sync with it; a call that did not sync returns ``None``."""

    @functools.wraps(original)
    async def fit_update_weights(self, *args, **kwargs):
        out = await original(self, *args, **kwargs)
        if out is not None:
            _clock(self).published(int(self.current_param_version))
        return out

    setattr(fit_update_weights, _MARK, True)
    return fit_update_weights


def _with_separated_metrics(original):
    @functools.wraps(original)
    def fit_collect_metrics(self, batch, *args, **kwargs):
        out = original(self, batch, *args, **kwargs)
        try:
            metrics = separated_step_metrics(
                self, batch.non_tensor_batch, getattr(self, "timing_raw", {}).get("gen")
            )
            self.metrics.update(metrics)
        except Exception as exc:  # noqa: BLE001 -- our numbers never fail verl's step
            log.warning("modal_rl async metrics unavailable: %r", exc)
        return out

    setattr(fit_collect_metrics, _MARK, True)
    return fit_collect_metrics


def _clock(trainer):
    from modal_rl.asyncrl.policy_age import UpdateClock

    return trainer.__dict__.setdefault(_CLOCK, UpdateClock())


def separated_step_metrics(trainer, columns: dict, trainer_wait_s: float | None) -> dict[str, float]:
    """One step's ``modal_rl/async/...`` numbers of a separation trainer from its batch's
    ``non_tensor_batch`` (verl's agent loop makes each ``extra_fields`` key a column), in
    optimizer updates (``UpdateClock``); ``{}`` when no sample has a record."""
    from modal_rl.asyncrl.metrics import step_numbers

    clock = _clock(trainer)
    records = columns.get(VERSIONS)
    if records is None or not any(isinstance(r, dict) for r in records):
        clock.trainer_age()  # the step is over either way
        return {}
    idles = columns.get(IDLE, [None] * len(records))
    extra = [{VERSIONS: r, IDLE: i} for r, i in zip(records, idles, strict=True)]
    idle = engine_idle(extra, trainer.__dict__.setdefault(_IDLE_SEEN, {}))
    samples = clock.step_samples(sample_records(extra))
    return step_numbers(samples, engine_idle_s=idle, trainer_wait_s=trainer_wait_s)


def patch_separation(module) -> None:
    trainer = module.SeparateRayPPOTrainer
    wrappers = {
        "_update_actor": _counting_updates,
        "_fit_update_weights": _publishing,
        "_fit_collect_metrics": _with_separated_metrics,
    }
    for name, wrap in wrappers.items():
        if not getattr(getattr(trainer, name), _MARK, False):
            setattr(trainer, name, wrap(getattr(trainer, name)))


def patch_fully_async(module) -> None:
    """verl's fully-async trainer (a Ray actor class) syncs in a method of its own; its update
    and metrics methods are the separation trainer's, wrapped by :func:`patch_separation`."""
    trainer = module.FullyAsyncTrainer.__ray_actor_class__
    if not getattr(trainer.__dict__["_fit_update_weights"], _MARK, False):
        trainer._fit_update_weights = _publishing_versions(trainer.__dict__["_fit_update_weights"])


def installed() -> bool:
    module = sys.modules.get(TARGET)
    return module is not None and getattr(module.FullyAsyncLLMServerClient.generate, _MARK, False)


after_import(TARGET, loudly("trajectory versions", lambda: patch(sys.modules[TARGET])))
after_import(METRICS_TARGET, loudly("async step metrics", lambda: patch_metrics(sys.modules[METRICS_TARGET])))
after_import(
    SEPARATION_TARGET,
    loudly("separation step metrics", lambda: patch_separation(sys.modules[SEPARATION_TARGET])),
)
after_import(
    FULLY_ASYNC_TARGET,
    loudly("fully-async sync labels", lambda: patch_fully_async(sys.modules[FULLY_ASYNC_TARGET])),
)
