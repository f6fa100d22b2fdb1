"""Installs the CPU boundary in this process (see ``slime_modal.cpu``). Idempotent."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

ENV = "MODAL_RL_SLIME_CPU"
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
_installed = False


class _FirstImport(importlib.abc.MetaPathFinder):
    """Runs ``before`` just before the package ``name`` is first imported, or ``after`` once its
    ``__init__`` ran (``after`` may import the package's modules; ``before`` must not)."""

    def __init__(self, name: str, before=None, after=None):
        self.name, self.before, self.after = name, before, after

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        if self.before is not None:
            self.before()
        spec = importlib.util.find_spec(fullname)
        if self.after is None or spec is None or spec.loader is None:
            return spec
        run, after = spec.loader.exec_module, self.after

        def exec_module(module):
            run(module)
            after()

        spec.loader.exec_module = exec_module
        return spec


def on_first_import(name: str, before=None, after=None) -> None:
    if name in sys.modules:
        for action in (before, after):
            if action is not None:
                action()
    else:
        sys.meta_path.insert(0, _FirstImport(name, before, after))


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from slime_modal.cpu import accelerator, cuda_on_cpu, torchvision_ops

    torchvision_ops.install()
    on_first_import("slime", after=accelerator.register)
    on_first_import("megatron", before=cuda_on_cpu.install)


def job_env() -> dict[str, str]:
    """The env a CPU-mode job adds (beside ``PYTHONPATH``, which gets :data:`BOOT_DIR`)."""
    return {
        ENV: "1",
        "SLIME_ACCELERATOR": "cpu",
        "SGLANG_USE_CPU_ENGINE": "1",
        "RAY_USE_UVLOOP": "0",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        # slime compiles parts of its loss with torch.compile; on CPU, inductor would build C++
        # kernels with the host compiler on every start, for a model this size slower than eager
        "TORCHDYNAMO_DISABLE": "1",
    }
