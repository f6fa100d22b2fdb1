"""Warnings that are expected on a CPU run, each silenced where it is raised, by its exact text.

None of these says anything about the run a user could act on; each is named here with where
it comes from and why it is expected, and matched narrowly (its logger or module, its message
prefix), so any *other* warning from the same place still shows:

- verl ``verl/workers/engine/__init__.py``: ``<name> engine is not available:
  ModuleNotFoundError(...)`` for the optional training engines (torchtitan, veomni,
  automodel, mindspeed, megatron) not installed on a CPU host; the run uses FSDP2.
- verl ``verl/trainer/ppo/utils.py`` ``need_critic``: ``Disabled critic as
  algorithm.adv_estimator != gae`` — GRPO has no critic by design.
- verl ``verl/plugin/platform/platform_manager.py``: ``Platform override from VERL_PLATFORM:
  cpu`` (INFO: the launcher set it on purpose) and, in the launcher validating a job for a
  GPU cluster on a host without one, ``No supported accelerator detected … Falling back to
  'nvidia'`` / ``Platform 'nvidia' … is registered but not available`` (the cluster has the
  GPUs, not this host; :func:`quiet_remote_platform_probe`).
- vLLM ``vllm/model_executor/models/utils.py``: ``Attempted to load weight … with dtype
  torch.float32 into parameter with dtype torch.bfloat16`` at every weight sync: the FSDP2
  actor trains in fp32 and vLLM serves bf16, so each sync narrows on purpose.
- transfer_queue ``utils/common.py``: ``target_num_threads 8 should not exceed total physical
  CPU cores N`` on every put/get — fixed at the source instead: ``TQ_NUM_THREADS`` (read by
  transfer_queue at import) is set to this host's physical cores (:func:`worker_env`).

Invariant: :func:`install` is idempotent and only adds filters; it is called in the launcher
and, through ``verl_modal.cpu.platform`` (imported by every verl process of a CPU run), in
every worker, before the warnings fire.
"""

from __future__ import annotations

import logging
import os
import warnings

ENGINE_MODULES = r"verl\.workers\.engine"
ENGINE_WARNING = (
    r"(torchtitan|veomni|automodel|mindspeed|megatron) engine is not available: ModuleNotFoundError"
)
CRITIC_WARNING = r"Disabled critic as algorithm\.adv_estimator != gae"
PLATFORM_LOGGER = "verl.plugin.platform.platform_manager"
VLLM_LOAD_LOGGER = "vllm.model_executor.models.utils"
TQ_THREADS_ENV = "TQ_NUM_THREADS"
TQ_DEFAULT_THREADS = 8  # transfer_queue's default

_MARK = "_verl_modal_quiet"


class _DropMessages(logging.Filter):
    """Drops records of one logger whose message template starts with one of ``prefixes``
    and (when given) whose arguments pass ``args_match``."""

    def __init__(self, prefixes: tuple[str, ...], args_match=None):
        super().__init__()
        self.prefixes = prefixes
        self.args_match = args_match
        setattr(self, _MARK, prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if not msg.startswith(self.prefixes):
            return True
        return self.args_match is not None and not self.args_match(record.args)


def _add_filter(logger_name: str, prefixes: tuple[str, ...], args_match=None) -> None:
    logger = logging.getLogger(logger_name)
    if any(getattr(f, _MARK, None) == prefixes for f in logger.filters):
        return
    logger.addFilter(_DropMessages(prefixes, args_match))


def _fp32_into_bf16(args) -> bool:
    """The dtype warning's args are ``(name, loaded dtype, parameter dtype)``."""
    if not isinstance(args, tuple) or len(args) != 3:
        return False
    return str(args[1]) == "torch.float32" and str(args[2]) in ("torch.bfloat16", "torch.float16")


def quiet_critic_notice() -> None:
    warnings.filterwarnings("ignore", message=CRITIC_WARNING, category=UserWarning)


def quiet_remote_platform_probe() -> None:
    """In a launcher validating a job for a GPU cluster: verl probes *this* host's
    accelerator, finds none and falls back to ``nvidia``, which is the cluster's platform."""
    quiet_critic_notice()
    _add_filter(
        PLATFORM_LOGGER,
        ("No supported accelerator detected", "Platform '%s' (%s) is registered but not available"),
    )


def install() -> None:
    """The CPU run's filters, in this process (see the module docstring)."""
    warnings.filterwarnings("ignore", message=ENGINE_WARNING, category=UserWarning, module=ENGINE_MODULES)
    quiet_critic_notice()
    _add_filter(PLATFORM_LOGGER, ("Platform override from VERL_PLATFORM",))
    _add_filter(VLLM_LOAD_LOGGER, ("Attempted to load weight %s with dtype %s into",), _fp32_into_bf16)


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Env for every process of a CPU run: transfer_queue's thread count capped at this host's
    physical cores (unless the user set it)."""
    environ = os.environ if environ is None else environ
    if TQ_THREADS_ENV in environ:
        return {}
    import psutil

    cores = psutil.cpu_count(logical=False) or 1
    return {TQ_THREADS_ENV: str(min(TQ_DEFAULT_THREADS, cores))}
