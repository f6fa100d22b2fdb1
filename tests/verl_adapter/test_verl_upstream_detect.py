"""``verl_modal.upstream`` reads each upstream seam off verl's source: the bug's form says
"absent", the fixed form says "present", and the adapters follow. The sources here are the
two forms of each spot, parsed as the detectors parse installed files (no verl import)."""

from __future__ import annotations

import ast

import pytest

from verl_modal import sample_mask, upstream

BACKEND_BUG = """
def initialize_global_process_group_ray(timeout_second=None, backend=None):
    backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
"""
BACKEND_FIXED = """
def initialize_global_process_group_ray(timeout_second=None, backend=None):
    device = get_device_name()
    backend = backend or ("cpu:gloo" if device == "cpu" else f"cpu:gloo,{device}:{get_nccl_backend()}")
"""
# patches/verl-main/0004: one helper builds the string for both initializers.
BACKEND_HELPER = """
def default_process_group_backend():
    device = get_device_name()
    if device == "cpu":
        return "cpu:gloo"
    return f"cpu:gloo,{device}:{get_nccl_backend()}"

def initialize_global_process_group_ray(timeout_second=None, backend=None):
    backend = backend or default_process_group_backend()
"""
POOL_BASE_SEAM = """
RESOURCE_POOL_MANAGER_CLASS_ENV = "VERL_RESOURCE_POOL_MANAGER_CLASS"

def resource_pool_manager_class():
    return ResourcePoolManager
"""
TQ_FIXED = """
INVALID_SAMPLE_KEY = "invalid_sample"

def exclude_invalid_sample(outputs, kwargs):
    return kwargs
"""
# patches/verl-main/0005: NeMo Gym's key, the response mask zeroed, the uid kept.
TQ_MASK_SAMPLE = """
MASK_SAMPLE_KEY = "mask_sample"

def mask_flagged_sample(outputs, validate):
    return False
"""
SERVER_OLD = (
    "async def abort(self):\n    await self.engine.pause_generation(wait_for_inflight_requests=False)\n"
)
SERVER_MODE = (
    'async def abort(self):\n    await self.engine.pause_generation(mode="abort", clear_cache=True)\n'
)


@pytest.fixture
def sources(monkeypatch):
    """Serve ``_tree(module)`` from a dict of module name -> source (absent: not installed)."""
    served: dict[str, str] = {}
    monkeypatch.setattr(upstream, "_tree", lambda m: ast.parse(served[m]) if m in served else None)
    detectors = (
        upstream.process_group_backend,
        upstream.invalid_sample_key,
        upstream.pause_mode_aware,
        upstream.pool_manager_class_env,
    )
    for detector in detectors:
        detector.cache_clear()
    yield served
    for detector in detectors:
        detector.cache_clear()


def test_process_group_backend_seam(sources):
    sources[upstream.DISTRIBUTED] = BACKEND_BUG
    assert upstream.process_group_backend() is False
    upstream.process_group_backend.cache_clear()
    sources[upstream.DISTRIBUTED] = BACKEND_FIXED
    assert upstream.process_group_backend() is True
    upstream.process_group_backend.cache_clear()
    sources[upstream.DISTRIBUTED] = BACKEND_HELPER
    assert upstream.process_group_backend() is True


def test_pool_manager_class_seam(sources):
    assert upstream.pool_manager_class_env() is None  # base.py not found: no seam
    upstream.pool_manager_class_env.cache_clear()
    sources[upstream.POOL_BASE] = "class ResourcePoolManager:\n    pass\n"
    assert upstream.pool_manager_class_env() is None
    upstream.pool_manager_class_env.cache_clear()
    sources[upstream.POOL_BASE] = POOL_BASE_SEAM
    assert upstream.pool_manager_class_env() == "VERL_RESOURCE_POOL_MANAGER_CLASS"


def test_invalid_sample_seam_and_the_flags_our_reward_manager_writes(sources):
    assert upstream.invalid_sample_key() is None
    assert sample_mask.reward_extra_info_flags(True) == {sample_mask.MASK_KEY: 1}
    upstream.invalid_sample_key.cache_clear()
    sources[upstream.AGENT_LOOP_TQ] = TQ_FIXED
    assert upstream.invalid_sample_key() == "invalid_sample"
    assert sample_mask.reward_extra_info_flags(True) == {sample_mask.MASK_KEY: 1, "invalid_sample": 1}
    assert sample_mask.reward_extra_info_flags(False) == {sample_mask.MASK_KEY: 0, "invalid_sample": 0}
    upstream.invalid_sample_key.cache_clear()
    sources[upstream.AGENT_LOOP_TQ] = TQ_MASK_SAMPLE
    assert upstream.invalid_sample_key() == "mask_sample"
    assert sample_mask.reward_extra_info_flags(True) == {sample_mask.MASK_KEY: 1, "mask_sample": 1}
    upstream.invalid_sample_key.cache_clear()
    sources[upstream.AGENT_LOOP_TQ] = TQ_MASK_SAMPLE.replace("MASK_SAMPLE_KEY =", "OTHER_KEY =")
    assert upstream.invalid_sample_key() is None


def test_pause_mode_seam_reads_the_server_call(sources):
    sources[upstream.VLLM_SERVER] = SERVER_OLD
    assert upstream.pause_mode_aware() is False
    upstream.pause_mode_aware.cache_clear()
    sources[upstream.VLLM_SERVER] = SERVER_MODE
    assert upstream.pause_mode_aware() is True


def test_sample_mask_leaves_sandbox_flags_to_verl_when_it_has_the_seam():
    class Out:
        extra_fields = {"reward_extra_info": {sample_mask.MASK_KEY: 1}}

    assert sample_mask.is_flagged([Out()]) is True
    assert sample_mask.is_flagged([Out()], sandbox=False) is False
    Out.extra_fields = {sample_mask.ENGINE_MASK_KEY: True, "reward_extra_info": {}}
    assert sample_mask.is_flagged([Out()], sandbox=False) is True
