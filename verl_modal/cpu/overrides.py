"""Env vars and Hydra overrides that run verl 0.9.1 on the ``cpu`` platform, and their
composition with the user's overrides into verl's own ``ppo_trainer`` config.

Three layers, later wins on the same key: :data:`CPU_DEFAULTS` (sizes for a small CPU host;
with :data:`ROLLOUT_POOL_DEFAULTS` for a config with a separate rollout pool), then the
workload's (e.g. :func:`verl_modal.cpu.tiny.overrides_for`; followed by
:data:`STREAMING_DEFAULTS` for a main that streams prompts), then the user's.
:data:`CPU_REQUIRED` is applied first and *checked* after composition: a user override that
contradicts one of them is an error naming the blocker it would bring back, not a hang.
"""

from __future__ import annotations

import os
from pathlib import Path

PLATFORM_MODULE = "verl_modal.cpu.platform"

# Env every process of the run needs (driver, TaskRunner, FSDP workers, vLLM server).
CPU_ENV = {
    "VERL_PLATFORM": "cpu",  # blocker 2: select our platform, never verl's nvidia fallback
    "VERL_ENGINE_DEVICE": "cuda",  # blocker 4: verl's FSDP engine is registered for "cuda"
    "VLLM_CPU_KVCACHE_SPACE": "1",  # blocker 1: KV cache GiB; skips vLLM's NUMA memory check
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}

# Of CPU_ENV, the ones a user may set differently in the launching shell.
TUNABLE_ENV = ("VLLM_CPU_KVCACHE_SPACE", "TOKENIZERS_PARALLELISM")

# key -> (value as Hydra writes it, why). Keys absent from verl's schema take "++".
CPU_REQUIRED: dict[str, tuple[str, str]] = {
    "trainer.device": ("cpu", "the cpu platform runs every rank on torch.device('cpu')"),
    "actor_rollout_ref.actor.strategy": (
        "fsdp2",
        "FSDP1's sync_module_states needs GPU tensors (blocker 6); FSDP2 runs on Gloo",
    ),
    "actor_rollout_ref.actor.fsdp_config.strategy": (
        "fsdp2",
        "see actor_rollout_ref.actor.strategy (blocker 6)",
    ),
    "++actor_rollout_ref.model.override_config.attn_implementation": (
        "sdpa",
        "FlashAttention2 does not exist on CPU (blocker 5)",
    ),
    "++actor_rollout_ref.rollout.enable_sleep_mode": (
        "False",
        "vLLM has no sleep mode on CPU (blocker 7)",
    ),
    "actor_rollout_ref.rollout.free_cache_engine": ("False", "needs vLLM sleep mode (blocker 7)"),
    "actor_rollout_ref.rollout.name": ("vllm", "vllm-cpu is the rollout engine installed for CPU"),
}

# Other values the cpu platform takes for a required key: modal_vllm's engines run outside the
# trainer's processes (locally: a vllm-cpu server process), so they need nothing of its platform.
ALSO_ACCEPTED = {"actor_rollout_ref.rollout.name": ("modal_vllm",)}

CPU_DEFAULTS = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "actor_rollout_ref.model.use_remove_padding=False",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "data.dataloader_num_workers=0",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.logger=[console]",
    "trainer.val_before_train=False",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "ray_kwargs.ray_init.num_cpus=8",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "reward.num_workers=1",
]


# For a config whose main runs the rollout apart from the trainer and sizes its pool from a
# top-level ``rollout`` section (verl's one-step-off and fully-async mains; their yaml asks
# for 8 GPUs): one replica on this host, and no hybrid engine (those mains refuse one).
ROLLOUT_POOL_DEFAULTS = [
    "rollout.nnodes=1",
    "rollout.n_gpus_per_node=1",
    "actor_rollout_ref.hybrid_engine=False",
]


def rollout_pool_defaults(config) -> list[str]:
    """:data:`ROLLOUT_POOL_DEFAULTS` when the composed ``config`` has a top-level ``rollout``
    pool section, else nothing (verl's ``ppo_trainer`` has none)."""
    section = config.get("rollout") if "rollout" in config else None
    return list(ROLLOUT_POOL_DEFAULTS) if section is not None and "nnodes" in section else []


# For a config whose main streams prompts one at a time to its trainer (verl's fully-async
# main: ``async_training`` section; its rollouter asserts data.train_batch_size=0 and
# data.gen_batch_size=1, and its trainer takes ppo_mini_batch_size x require_batches prompts a
# step): a workload's batch size would fail it, so this layer comes after the workload's.
STREAMING_DEFAULTS = ["data.train_batch_size=0"]


def streaming_defaults(config) -> list[str]:
    """:data:`STREAMING_DEFAULTS` when the composed ``config`` has verl's ``async_training``
    section, else nothing."""
    return list(STREAMING_DEFAULTS) if "async_training" in config else []


class OverrideError(ValueError):
    """A malformed override, or one that contradicts what the cpu platform needs."""


def override_key(override: str) -> str:
    """``"++a.b=1"`` -> ``"a.b"`` (``"+grp@pkg=x"`` -> ``"grp@pkg"``): the key as Hydra's own
    override parser reads it. Raises :class:`OverrideError` when Hydra refuses the key part
    (or there is no ``=``); the value is Hydra's to judge when the config is composed
    (:func:`compose`), which turns its refusal into an :class:`OverrideError` too.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    # Keys cannot hold "=" in Hydra's grammar: everything before the first "=" is the key part,
    # and "key=" (empty value) or "~key" is a complete override to Hydra.
    key_part, sep, _ = override.partition("=")
    try:
        parsed = OverridesParser.create().parse_override(key_part + sep)
    except HydraException as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OverrideError(f"not a Hydra override of the form key=value: {override!r} ({reason})") from None
    if not parsed.key_or_group:  # Hydra's grammar lets "=1" through; its config lookup would not
        raise OverrideError(f"not a Hydra override of the form key=value: {override!r} (no key)")
    return parsed.get_key_element().lstrip("+~")


def merge(*layers: list[str]) -> list[str]:
    """Concatenate override layers; an override replaces any earlier one with the same key."""
    merged: dict[str, str] = {}
    for layer in layers:
        for override in layer:
            key = override_key(override)
            merged.pop(key, None)  # re-insert so order follows the winning layer
            merged[key] = override
    return list(merged.values())


def required_overrides() -> list[str]:
    return [f"{key}={value}" for key, (value, _) in CPU_REQUIRED.items()]


def cpu_overrides(workload: list[str], user: list[str]) -> list[str]:
    """All overrides for a CPU run, in the order Hydra should apply them."""
    return merge(required_overrides(), CPU_DEFAULTS, workload, user)


def check_required(config) -> None:
    """Raise :class:`OverrideError` naming every CPU requirement the composed config breaks."""
    from omegaconf import OmegaConf

    problems = []
    for key, (want, why) in CPU_REQUIRED.items():
        path = key.lstrip("+")
        got = OmegaConf.select(config, path, default=None)
        accepted = (want, *ALSO_ACCEPTED.get(key, ()))
        if str(got).lower() not in (value.lower() for value in accepted):
            problems.append(f"{path}={got} (the cpu platform needs {want}: {why})")
    if problems:
        raise OverrideError("; ".join(problems))


def verl_config_dir() -> str:
    import verl.trainer.config

    return str(Path(verl.trainer.config.__file__).parent)


def compose(overrides: list[str], config_name: str = "ppo_trainer"):
    """verl's ``ppo_trainer`` config with ``overrides`` applied, as ``main_ppo`` would see it.

    Hydra's own errors (unknown key, bad value) come out as :class:`OverrideError` with
    Hydra's message, so the launcher can print one line.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for override in overrides:
        override_key(override)
    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise OverrideError(str(exc).strip().splitlines()[0]) from exc


def worker_env(extra_pythonpath: str | None = None) -> dict[str, str]:
    """:data:`CPU_ENV` plus what makes every Ray worker import our platform module.

    ``VERL_USE_EXTERNAL_MODULES`` is verl's own hook (read in ``verl/__init__``); existing
    modules in it are kept. ``PYTHONPATH`` gets the checkout so workers import ``verl_modal``
    even when modal-rl is not pip-installed.
    """
    env = dict(CPU_ENV)
    env.update({k: os.environ[k] for k in TUNABLE_ENV if k in os.environ})
    modules = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if PLATFORM_MODULE not in modules:
        modules.append(PLATFORM_MODULE)
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join(modules)
    root = extra_pythonpath or str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p != root]])
    return env
