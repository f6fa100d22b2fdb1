"""The actor's ``update_weights`` for ``modal_delta``: LoRA runs publish the adapter alone,
``sharded`` runs hand the checkpoint engine the training engine (no gather).

verl 0.9.1's checkpoint-engine path (``update_weights`` of the v1 actor worker with a backend
other than ``naive``) sends ``engine.get_per_tensor_param()``, which for a LoRA actor
(``actor_rollout_ref.model.lora_rank > 0``, not ``lora.merge``) is the frozen *base* weights
without the adapter: a disaggregated rollout never sees what was trained (verl #7495). When
the backend is ``modal_delta``, the rollout ``modal_vllm`` and the actor trains LoRA,
:func:`install` makes that call send
``get_per_tensor_param(base_sync_done=True)`` instead -- verl's own adapter export, the one its
colocated path uses -- filtered to the adapter tensors and cast to the rollout's dtype
(``modal_rl.weightsync.apply.lora.adapter_state``).

``sharded: true`` (``verl_modal.sharded``): verl 0.9.1 hands a checkpoint engine the training
engine only when the backend is literally ``delta_sharded``, and ``get_per_tensor_param()``'s
all-gathered stream otherwise; for a sharded ``modal_delta`` engine the same wrapper calls
``send_weights(self.actor.engine, ...)`` instead (the seam verl lacks is
``patches/verl/0009``). Anything else goes to verl's own code.

On the rollout side a ``modal_vllm`` replica serves the base model from the model path with
vLLM's LoRA on and loads each version as a versioned adapter (``replica``, ``replica_proxy``,
``modal_rl.weightsync.apply.vllm_lora``).

Invariants: the wrap is applied once per process, after ``verl.workers.engine_workers``
loads (the ``modal_delta`` plugin's import hook); the original always runs when the run is
neither a ``modal_delta`` LoRA run nor a sharded ``modal_delta`` run; the wrapper keeps verl's dispatch attributes (``wraps``).
"""

from __future__ import annotations

import functools
from typing import Any

TARGET = "verl.workers.engine_workers"
BACKEND = "modal_delta"
ROLLOUT = "modal_vllm"  # the rollout whose engines load adapter versions (verl's own vllm does not)
_MARK = "__verl_modal_lora__"


def _get(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for a dict, an OmegaConf node or verl's config dataclasses alike."""
    if config is None:
        return default
    getter = getattr(config, "get", None)
    return getter(key, default) if callable(getter) else getattr(config, key, default)


def adapter_settings(model_config: Any) -> dict | None:
    """``{"rank", "alpha", "target_modules"}`` of a run that trains a LoRA adapter and keeps it
    apart from the base (verl's ``model.lora_rank`` or ``model.lora.rank``, no ``lora.merge``);
    None for full fine-tuning or a merged-LoRA run (those sync full weights)."""
    lora = _get(model_config, "lora") or {}
    rank = int(_get(lora, "rank", 0) or 0) or int(_get(model_config, "lora_rank", 0) or 0)
    if rank <= 0 or bool(_get(lora, "merge", False)):
        return None
    targets = _get(model_config, "target_modules", "all-linear")
    targets = targets if isinstance(targets, str) else [str(t) for t in targets]
    return {"rank": rank, "alpha": float(_get(model_config, "lora_alpha", 16)), "target_modules": targets}


def _adapter_stream(worker) -> Any:
    """The actor's adapter tensors, as the rollout will serve them."""
    import torch

    from modal_rl.weightsync.apply.lora import adapter_state

    params, _peft_config = worker.actor.engine.get_per_tensor_param(base_sync_done=True)
    dtype = getattr(torch, str(_get(worker.config.rollout, "dtype", "bfloat16")))
    adapter, _ = adapter_state(params, dtype)
    return adapter.items()


def _merged_bytes(worker) -> dict[str, float]:
    """What this version would have cost as merged full weights (``compare_merged``): verl's
    own merged export, encoded by the checkpoint engine's shadow publisher (frames sent
    nowhere; ``ModalDeltaCheckpointEngine.measure``). Measurement only: it costs a merge and
    an encode per sync."""
    return worker.checkpoint_engine.measure(worker.actor.engine._merged_lora_per_tensor_param(), "merged_")


def _wrap() -> None:
    import sys

    cls = sys.modules[TARGET].ActorRolloutRefWorker
    original = cls.update_weights
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        if backend == BACKEND and getattr(self.checkpoint_engine, "sharded", False):
            from verl_modal.sharded import send_shards

            return await send_shards(self, global_steps, adapter_settings(self.config.model) is not None)
        adapter_engine = _get(self.config.rollout, "name") == ROLLOUT  # loads adapters by name
        if backend != BACKEND or not adapter_engine or adapter_settings(self.config.model) is None:
            return await original(self, global_steps=global_steps, mode=mode)
        metrics = await self.checkpoint_engine.send_weights(_adapter_stream(self), global_steps=global_steps)
        metrics = dict(metrics or {})
        if getattr(self.checkpoint_engine, "compare_merged", False):
            metrics.update(_merged_bytes(self))
        return metrics

    setattr(update_weights, _MARK, True)
    cls.update_weights = update_weights


def installed() -> bool:
    import sys

    module = sys.modules.get(TARGET)
    return bool(module is not None and getattr(module.ActorRolloutRefWorker.update_weights, _MARK, False))


def install() -> None:
    """Wrap the actor worker's ``update_weights`` once ``engine_workers`` loads (idempotent)."""
    from verl_modal._register import after_import, loudly

    after_import(TARGET, loudly("LoRA adapter-only and sharded sync for modal_delta", _wrap))
