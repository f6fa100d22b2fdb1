"""The sandboxed variant of the tiny CPU run: Hydra overrides that score the ``code`` task by
running each response in bubblewrap sandboxes, and offer the sandboxed code tool.

Used by ``python -m verl_modal --tiny DIR --tiny-task code`` (see ``tiny.overrides_for``):

- reward: the ``modal_sandbox`` reward manager (registered by our ``verl.plugins`` entry
  point) with its sandbox settings under ``reward.reward_kwargs``; no custom reward function,
  so the manager scores with ``verl_modal.reward.compute_score``;
- tools: verl's ``tool_agent`` loop with ``verl_modal/configs/sandbox_code_tool.yaml``. The
  random tiny model never writes a ``<tool_call>``, so the tool is loaded but not called;
  the reward is what runs sandboxes on this variant.

Add ``+reward.reward_kwargs.metrics_dir=DIR`` to get the reward's sandbox counters as
``DIR/sandbox-reward-<pid>.json`` (see ``verl_modal.reward_manager``).
"""

from __future__ import annotations

from pathlib import Path

TOOL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sandbox_code_tool.yaml"

# Small on purpose: 2 cores shared by the trainer, vLLM and the sandboxes.
SANDBOX_SETTINGS = {"min_warm": 1, "max_live": 4, "exec_timeout_s": 5, "memory_mb": 512}


def code_task_overrides(*, tools: bool = True) -> list[str]:
    out = ["reward.reward_manager.name=modal_sandbox"]
    out += [f"+reward.reward_kwargs.{k}={v}" for k, v in SANDBOX_SETTINGS.items()]
    if tools:
        out += [
            "actor_rollout_ref.rollout.multi_turn.enable=True",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        ]
    return out
