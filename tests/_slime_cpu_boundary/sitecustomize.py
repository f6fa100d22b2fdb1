"""This host's accelerator, for slime's rollout actors in the rollout-manager tests.

The second boundary of those tests (the first is ``sglang/`` next to this file): slime's
``SGLangEngine.init`` maps the engine's GPU id through the process's accelerator
(``slime.utils.accelerator.resolve_visible_device_id``) even for an external engine, whose
GPUs are elsewhere, and this CPU-only host has none. A ``cpu`` backend is registered through
slime's own plugin API (``register_accelerator``, "without changing Slime core"); Python runs
this module at the start of every interpreter that has this directory on ``PYTHONPATH`` (the
tests' Ray workers), and it does nothing where slime is not importable.
"""

import importlib.util

if importlib.util.find_spec("slime") is not None:
    import torch
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    class HostCpu(Accelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        @property
        def visible_devices_env(self) -> str:
            return "MODAL_RL_TEST_VISIBLE_CPUS"  # never set: ids pass through unchanged

        def is_available(self) -> bool:
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None) -> str:
            return "cpu"

        def set_device(self, index) -> None:
            pass

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device=None) -> None:
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self) -> None:
            pass

        def mem_get_info(self, device=None):
            return (0, 0)

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

    accelerator.register_accelerator("cpu", HostCpu, lambda: True, priority=-1)
