"""``verl.plugins`` entry point: registers the ``modal_vllm`` rollout replica with verl.

``RolloutReplicaRegistry`` lives in ``verl.workers.rollout.replica``, which imports Ray and the
worker stack; importing it at ``import verl`` would cost seconds in every process. So, as for
the checkpoint engine (``_ckpt_register``), registration runs right after that module loads.
The registry takes a loader, so registering costs nothing: ``verl_modal.replica`` is imported
only when verl asks for ``modal_vllm`` (and an import error then reaches that caller).

A registration failure is logged at ERROR (verl logs a failing plugin at DEBUG only).
"""

from __future__ import annotations

import logging
import sys

from verl_modal._ckpt_register import run_after_import

log = logging.getLogger("verl_modal")

TARGET = "verl.workers.rollout.replica"
NAME = "modal_vllm"


def load_replica_class():
    from verl_modal.replica import ModalVLLMReplica

    return ModalVLLMReplica


def register() -> None:
    try:
        sys.modules[TARGET].RolloutReplicaRegistry.register(NAME, load_replica_class)
    except Exception as exc:
        log.error("verl_modal: could not register rollout replica %r: %r", NAME, exc)


run_after_import(TARGET, register)
