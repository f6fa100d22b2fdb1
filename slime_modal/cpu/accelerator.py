"""A ``cpu`` backend for slime's accelerator API, registered through slime's own
``register_accelerator`` (selected with ``SLIME_ACCELERATOR=cpu``, which CPU mode sets).

Devices are the host: one logical device, index 0 (Ray's logical GPUs map onto it), gloo for
every process group, one stream that orders nothing (CPU work runs in program order), no caching allocator, the CPU generator for RNG."""

from __future__ import annotations

import contextlib
from typing import Any

NAME = "cpu"
# Ray gives each actor of a logical GPU an id under CUDA_VISIBLE_DEVICES; on one host they all
# mean the same CPU, so ids pass through unmapped (this variable is never set).
VISIBLE_ENV = "MODAL_RL_SLIME_CPU_VISIBLE_DEVICES"


def _backend_class():
    import torch
    from slime.utils.accelerator.base import Accelerator

    from slime_modal.cpu.cuda_on_cpu import HOST_STREAM, HostEvent, HostStream

    class HostCpu(Accelerator):
        name = NAME
        device_type = "cpu"
        communication_backend_name = "gloo"

        @property
        def visible_devices_env(self) -> str:
            return VISIBLE_ENV

        def is_available(self) -> bool:
            return True

        def device(self, index: Any = None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index: Any = None) -> str:
            return "cpu"

        def set_device(self, index: Any) -> None:
            pass

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def synchronize(self, device: Any = None) -> None:
            pass

        def current_stream(self, device: Any = None) -> Any:
            return HOST_STREAM

        def default_stream(self, device: Any = None) -> Any:
            return HOST_STREAM

        def stream(self, stream: Any):
            return contextlib.nullcontext()

        @property
        def Stream(self) -> Any:  # noqa: N802 - slime's accelerator interface
            return HostStream

        @property
        def Event(self) -> Any:  # noqa: N802 - slime's accelerator interface
            return HostEvent

        def empty_cache(self) -> None:
            pass

        def mem_get_info(self, device: Any = None) -> tuple[int, int]:
            import psutil

            vm = psutil.virtual_memory()
            return int(vm.available), int(vm.total)

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        def memory_reserved(self, device: Any = None) -> int:
            return 0

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def distributed_device_id(self, index: Any = None) -> None:
            return None  # gloo binds no device

        def autocast(self, *args: Any, **kwargs: Any):
            return torch.autocast("cpu", *args, **kwargs)

    return HostCpu


def register() -> None:
    """Register the backend (slime must be importable; called when it is first imported)."""
    from slime.utils import accelerator

    accelerator.register_accelerator(
        NAME, _backend_class(), lambda: True, priority=-1, communication_backends=("gloo",)
    )
