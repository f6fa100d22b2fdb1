"""A ``cpu`` platform for verl 0.9.1, registered through verl's own ``PlatformRegistry``.

verl ships platforms for NVIDIA, Huawei and AMD only; on a machine without GPUs it falls
back to ``nvidia``, asks Ray for GPUs and waits forever (blocker 2 in
``docs/architecture.md`` "verl on CPU"). This module adds the missing one.

Invariants:
- Importing this module registers the platform (idempotent) and, when the process runs with
  ``VERL_PLATFORM=cpu``, installs the run-time fixes of :mod:`verl_modal.cpu.patches` and
  the filters for the run's expected warnings (:mod:`verl_modal.cpu.quiet`).
  verl imports it in every process that imports verl, through ``VERL_USE_EXTERNAL_MODULES``
  (set by our launcher for all Ray workers) or the ``verl.plugins`` entry point.
- The platform is never picked by verl's auto-detection: only ``VERL_PLATFORM=cpu`` selects
  it, so installing modal-rl changes nothing for a GPU run.
- Each rank is one logical GPU: Ray schedules it as ``"GPU"`` (declared to Ray with
  ``ray_init.num_gpus``), and inside the process the device is ``torch.device("cpu")``.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"
DEVICE_NAME = "CPU"

# Env vars vLLM's CPU backend needs in every rollout process (blocker 1): the KV cache size in
# GiB, set directly so vLLM skips its NUMA-node memory check (8.7 GiB reported on a 24 GiB host).
ROLLOUT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, what ``mem_get_info`` means on a CPU."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


class _CpuDeviceModule(types.ModuleType):
    """Stand-in for ``torch.cuda`` where verl calls ``get_torch_device().<fn>()``.

    Streams, events, synchronize and device counts come from ``torch.cpu``; allocator calls
    (``empty_cache``, memory fractions, IPC collect) are no-ops because CPU tensors live in
    the host allocator; device-memory counters read 0 (there is no device memory); the RNG
    is the CPU generator. Anything else raises ``AttributeError`` naming this module, so a
    verl call path we have not met fails loudly instead of silently doing nothing.
    """

    Stream = torch.cpu.Stream
    Event = torch.cpu.Event
    stream = staticmethod(torch.cpu.stream)
    current_stream = staticmethod(torch.cpu.current_stream)
    synchronize = staticmethod(torch.cpu.synchronize)
    is_available = staticmethod(lambda: True)
    is_initialized = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: torch.device("cpu"))
    set_device = staticmethod(_noop)
    get_device_name = staticmethod(lambda *_a: DEVICE_NAME)
    empty_cache = staticmethod(_noop)
    ipc_collect = staticmethod(_noop)
    set_per_process_memory_fraction = staticmethod(_noop)
    reset_peak_memory_stats = staticmethod(_noop)
    memory_allocated = staticmethod(_zero)
    memory_reserved = staticmethod(_zero)
    max_memory_allocated = staticmethod(_zero)
    max_memory_reserved = staticmethod(_zero)
    mem_get_info = staticmethod(lambda *_a: _host_memory())
    get_rng_state = staticmethod(lambda *_a: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *_a: torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))
    manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"verl_modal cpu platform: the stand-in for torch.cuda has no {name!r}; "
            "this verl code path is not supported on CPU yet"
        )


cpu_device_module = _CpuDeviceModule("verl_modal.cpu.device")


class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts: Gloo collectives, no IPC, logical GPUs in Ray."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a GPU host with modal-rl installed must keep verl's choice.
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME

    def current_device(self) -> torch.device:
        # verl passes this to ``.to(device=...)``; an int would mean "accelerator 0".
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cpu.synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets it for actors holding "GPU"s; on CPU it only names the logical GPU.
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {k: os.environ.get(k, v) for k, v in ROLLOUT_ENV.items()}

    def cudart(self) -> Any:
        return None


def register() -> type[PlatformCPU]:
    """Register :class:`PlatformCPU` as ``cpu`` with verl (idempotent) and return it."""
    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    return PlatformCPU


def selected() -> bool:
    """True when this process runs verl on the cpu platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


register()
if selected():
    from verl_modal.cpu import patches, quiet

    patches.install()
    quiet.install()  # the CPU run's expected warnings, before they fire in this process
