"""Inference engines: the ``Engine`` port (``base``), one file per kind of server (``vllm``,
``sglang``), and the engine lifecycle: pools that start servers (``pool``, ``pool_local``,
``pool_modal``), the supervisor that keeps them serving the current weights (``supervisor``),
their health checks, auth, route guard and key forwarder.

``ENGINES`` maps an engine name to its ``Engine`` class (``modal_rl.registry``: imported only
when chosen; a package adds one through the ``modal_rl.engines`` entry-point group). Adding a
kind of server is one file and one ``ENGINES.add`` line.
"""

from __future__ import annotations

from typing import Any

from modal_rl.registry import Registry

ENGINES = Registry("engine", group="modal_rl.engines")
ENGINES.add("vllm", "modal_rl.engines.vllm:VllmEngine")
ENGINES.add("vllm-lora", "modal_rl.engines.vllm:VllmLoraEngine")
ENGINES.add("sglang", "modal_rl.engines.sglang:SglangEngine")


def get_engine(name: str, **settings: Any):
    """The ``Engine`` registered as ``name``, made with ``settings``."""
    return ENGINES.load(name)(**settings)


# What the adapters use, named here so they import this package and never its files; each
# name's module loads when first asked for (importing the package stays light).
PUBLIC = {
    "Engine": "modal_rl.engines.base",
    "EngineSpec": "modal_rl.engines.pool",
    "EngineStartError": "modal_rl.engines.pool",
    "engine_key": "modal_rl.engines.pool",
    "get_engine_pool": "modal_rl.engines.pool",
    "parse_cpus": "modal_rl.engines.pool",
    "EngineSupervisor": "modal_rl.engines.supervisor",
    "EngineLost": "modal_rl.engines.supervisor",
    "WeightSource": "modal_rl.engines.supervisor",
    "ForwardedEngines": "modal_rl.engines.forwarded",
    "EnginePusher": "modal_rl.engines.vllm_push",
    "bearer_header": "modal_rl.engines.auth",
    "check_key_safe_url": "modal_rl.engines.auth",
    "WeightDirs": "modal_rl.engines.sglang_paths",
}


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'modal_rl.engines' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
