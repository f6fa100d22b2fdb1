"""``verl.plugins`` entry point: registers the ``modal_sandbox`` reward manager with verl.

verl 0.9.1 selects a reward manager by name (``reward.reward_manager.name``, source
``register``) from ``REWARD_MANAGER`` in ``verl.experimental.reward_loop.reward_manager``;
``RewardManagerConfig`` checks the name against it. Registration is deferred (see
``verl_modal._register``) until that package has loaded, so ``import verl`` stays light.

Tools have no by-name registry in verl 0.9.1 (a tool config names its class path), so the
sandboxed tool needs no registration: ``verl_modal.tools.SandboxCodeTool``.

The sample mask (``verl_modal.sample_mask``) is installed the same way, once verl's agent-loop
module loads: a sample whose sandbox failed is masked out of the loss, not scored; and so is
the group rule for masked samples (``verl_modal.group_advantage``), once verl's advantage
estimators load: a masked sample moves no sibling's statistics and never leaves one alone with
its raw score as its advantage.

Invariant: if registration fails, the failure is logged at ERROR and ``modal_sandbox`` is
still listed, bound to a stand-in whose construction raises ``ImportError`` with the cause,
so a run asking for it fails with the reason instead of "not registered".
"""

from __future__ import annotations

import sys

from verl_modal._register import after_import, as_import_error, loudly

TARGET = "verl.experimental.reward_loop.reward_manager"
NAME = "modal_sandbox"
MANAGER_MODULE = "verl_modal.reward_manager"
MASK_TARGET = "verl.experimental.agent_loop.agent_loop"
ADVANTAGE_TARGET = "verl.trainer.ppo.core_algos"


def _import_manager() -> None:
    __import__(MANAGER_MODULE)  # its @register(NAME) class decorator registers it


def _record(exc: Exception) -> None:
    cause = as_import_error(exc)

    class UnavailableRewardManager:
        def __init__(self, *args, **kwargs):
            raise ImportError(f"reward manager {NAME!r} failed to register: {cause}") from cause

    sys.modules[f"{TARGET}.registry"].REWARD_MANAGER.setdefault(NAME, UnavailableRewardManager)


def _install_mask() -> None:
    from verl_modal import sample_mask

    sample_mask.install()


def _install_group_rule() -> None:
    from verl_modal import group_advantage

    group_advantage.install()


register = loudly(f"reward manager {NAME!r}", _import_manager, _record)

after_import(TARGET, register)
after_import(MASK_TARGET, loudly("the sandbox sample mask", _install_mask))
after_import(ADVANTAGE_TARGET, loudly("the masked-sample group rule", _install_group_rule))
