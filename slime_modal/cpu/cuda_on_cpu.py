"""Megatron's CUDA calls answered on the CPU: only for a CPU try-out of a slime run.

Megatron-LM calls ``torch.cuda`` directly in hundreds of places (the current device, streams,
events, the RNG tracker, memory statistics), builds tensors with ``device='cuda'`` or
``device=torch.cuda.current_device()``, and checks ``param.type()`` against
``'torch.cuda.*Tensor'`` names. On a host without CUDA, :func:`install` makes those calls
work on the CPU:

- the ``torch.cuda`` functions Megatron uses are replaced by CPU answers (one device, index 0;
  streams and events that do nothing; the CPU generator for RNG; zero memory statistics);
- a ``TorchFunctionMode`` maps every CUDA device in a torch call (``'cuda'``, ``'cuda:N'``,
  an int index, ``Tensor.cuda()``) to ``cpu``, drops ``pin_memory``, and answers ``Tensor.type()`` with the CUDA
  name of a CPU tensor's type.

It is installed in a process when it first imports ``megatron`` (``slime_modal.cpu.activate``),
which says so in one line on stderr. It is invasive by nature, which is why it exists only in
``MODAL_RL_SLIME_CPU=1`` mode; nothing of it is used on a GPU host.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

_mode = None
_MODE_LOCK = threading.Lock()


class HostStream:
    """A CUDA stream's interface, with nothing to order: CPU work runs in program order."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.device = "cpu"

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event or HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostStream)

    def __hash__(self) -> int:
        return 0


HOST_STREAM = HostStream()  # the one stream there is


class HostEvent:
    def __init__(self, *args: Any, **kwargs: Any):
        import time

        self._clock = time.perf_counter
        self._t = None

    def record(self, stream: Any = None) -> None:
        self._t = self._clock()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        return ((end._t or 0.0) - (self._t or 0.0)) * 1000.0


def _returning(value: Any):
    """A new function returning ``value``: each replaced name gets its own function object
    (torch's compiler keeps one rule per torch function object and refuses duplicates)."""

    def answer(*args: Any, **kwargs: Any) -> Any:
        return value

    return answer


class _Props:
    name = "cpu"
    major, minor = 0, 0
    multi_processor_count = 1

    @property
    def total_memory(self) -> int:
        import psutil

        return int(psutil.virtual_memory().total)


def _cuda_functions(torch: Any) -> dict[str, Any]:
    def get_rng_state(device: Any = None) -> Any:
        return torch.get_rng_state()

    def set_rng_state(state: Any, device: Any = None) -> None:
        torch.set_rng_state(state)

    def manual_seed(seed: int) -> None:
        # the generator itself: torch.manual_seed calls torch.cuda.manual_seed_all
        torch.default_generator.manual_seed(seed)

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    return {
        "is_available": lambda: False,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": _returning(None),
        "synchronize": _returning(None),
        "Stream": HostStream,
        "Event": HostEvent,
        "current_stream": lambda device=None: HOST_STREAM,
        "default_stream": lambda device=None: HOST_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "set_stream": _returning(None),
        "device": lambda device=None: contextlib.nullcontext(),
        "empty_cache": _returning(None),
        "ipc_collect": _returning(None),
        "memory_allocated": _returning(0),
        "memory_reserved": _returning(0),
        "max_memory_allocated": _returning(0),
        "max_memory_reserved": _returning(0),
        "reset_peak_memory_stats": _returning(None),
        "reset_max_memory_allocated": _returning(None),
        "memory_stats": lambda device=None: {},
        "mem_get_info": mem_get_info,
        "get_device_properties": lambda device=None: _Props(),
        "get_device_capability": lambda device=None: (0, 0),
        "get_device_name": lambda device=None: "cpu",
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "manual_seed": manual_seed,
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(seed),
        "default_generators": (torch.default_generator,),
        "_lazy_call": lambda fn, **kwargs: fn(),
        "_lazy_init": _returning(None),
        "is_initialized": lambda: True,
        "is_bf16_supported": lambda *a, **k: True,
    }


def _is_cuda(device: Any) -> bool:
    import torch

    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device in torch calls
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _map(value: Any) -> Any:
    return "cpu" if _is_cuda(value) else value


def _make_mode() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    tensor_type = torch.Tensor.type
    to_device_methods = {torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros}

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is tensor_type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
            if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
                return args[0]
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False  # page-locked memory exists only beside a GPU
            if "device" in kwargs:
                kwargs["device"] = _map(kwargs["device"])
            if func in to_device_methods and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaOnCpu()


def install() -> None:
    """Replace Megatron's ``torch.cuda`` calls and enter the device-mapping mode (idempotent)."""
    global _mode
    with _MODE_LOCK:
        if _mode is not None:
            return
        import torch
        import torch.cuda.random

        for name, value in _cuda_functions(torch).items():
            setattr(torch.cuda, name, value)
            if hasattr(torch.cuda.random, name):
                setattr(torch.cuda.random, name, value)
        _mode = _make_mode()
        _mode.__enter__()
    print(
        "[slime_modal.cpu] CPU mode: Megatron's torch.cuda calls and CUDA devices are mapped to the CPU "
        "in this process",
        file=sys.stderr,
        flush=True,
    )
