"""``verl.plugins`` entry point: registers the ``modal_delta`` checkpoint engine with verl.

The registration is deferred (see ``verl_modal._register``) until
``verl.checkpoint_engine.base`` — where ``CheckpointEngineRegistry`` lives — finishes
loading, so ``import verl`` does not pay for Ray, tensordict and the rollout adapters.

It also arms ``verl_modal.lora`` (a LoRA actor publishes its adapter alone through
``modal_delta``; a ``sharded`` one publishes each rank's shard) for when verl's actor worker
module loads.

Invariants:
- registration happens at most once per process, after the base module executed;
- a registration failure is logged at ERROR and recorded with verl's own
  ``CheckpointEngineRegistry.record_import_error``, so asking for ``modal_delta`` names the
  cause instead of "not registered".
"""

from __future__ import annotations

import sys

from verl_modal._register import after_import, as_import_error, loudly

TARGET = "verl.checkpoint_engine.base"
ENGINE_MODULE = "verl_modal.checkpoint_engine"


def _import_engine() -> None:
    __import__(ENGINE_MODULE)  # its class decorator registers it


def _record(exc: Exception) -> None:
    base = sys.modules.get(TARGET)
    if base is not None:
        base.CheckpointEngineRegistry.record_import_error(ENGINE_MODULE, as_import_error(exc))


register = loudly("checkpoint engine 'modal_delta'", _import_engine, _record)

after_import(TARGET, register)


def _install_lora() -> None:
    from verl_modal import lora

    lora.install()  # LoRA adapters alone, sharded publishing without a gather (verl_modal.lora)


loudly("LoRA adapter-only and sharded sync for modal_delta", _install_lora)()
