"""``verl.plugins`` entry point: registers the ``modal_vllm`` rollout replica with verl.

``RolloutReplicaRegistry`` lives in ``verl.workers.rollout.replica``, which imports Ray and the
worker stack; importing it at ``import verl`` would cost seconds in every process. So, as for
the checkpoint engine, registration runs right after that module loads (``_register``).
The registry takes a loader, so registering costs nothing: ``verl_modal.replica`` is imported
only when verl asks for ``modal_vllm`` (and an import error then reaches that caller).

A registration failure is logged at ERROR (verl logs a failing plugin at DEBUG only).
The same entry point defers ``verl_modal.async_versions`` (a ``modal_vllm`` answer's version
span kept across verl's partial-rollout client) until verl's ``llm_server`` module loads.
"""

from __future__ import annotations

import sys

from verl_modal import async_versions  # noqa: F401 -- registers its own post-import patch
from verl_modal._register import after_import, loudly

TARGET = "verl.workers.rollout.replica"
NAME = "modal_vllm"


def load_replica_class():
    from verl_modal.replica import ModalVLLMReplica

    return ModalVLLMReplica


def _register() -> None:
    sys.modules[TARGET].RolloutReplicaRegistry.register(NAME, load_replica_class)


register = loudly(f"rollout replica {NAME!r}", _register)

after_import(TARGET, register)
