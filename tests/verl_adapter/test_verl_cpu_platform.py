"""The cpu platform and the two run-time fixes, against real verl 0.9.1 and torch.distributed.

Process-wide state (verl's platform singleton, patched torch functions) is exercised in
fresh subprocesses, so each case sees exactly what a Ray worker would.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from tests.verl_plugin_helpers import run_python

ROOT = Path(__file__).resolve().parents[2]


def run_py(code: str, env: dict[str, str] | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "VLLM_"))}
    full_env.update({"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
    full_env.update(env or {})
    return run_python(code, full_env, timeout)


CPU_ENV = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_modal.cpu.platform"}


def test_registered_with_verl_and_describes_a_cpu_device():
    from verl.plugin.platform import PlatformRegistry

    from verl_modal.cpu.platform import PlatformCPU

    assert PlatformRegistry.get("cpu") is PlatformCPU
    p = PlatformCPU()
    assert p.device_name == "cpu"
    assert p.communication_backend_name() == "gloo"
    assert p.current_device() == torch.device("cpu")
    assert p.device_count() == 1
    assert p.ray_resource_name() == "GPU"
    assert p.ray_resource_options(1) == {"num_gpus": 1}
    assert p.is_ipc_supported() is False
    assert p.get_device_capability() == (None, None)
    assert p.rollout_env_vars()["VLLM_CPU_KVCACHE_SPACE"]


def test_device_module_stands_in_for_torch_cuda():
    from verl_modal.cpu.platform import cpu_device_module as dev

    assert dev.get_device_name() == "CPU"  # verl's flops counter needs a name
    assert dev.current_device() == torch.device("cpu")
    free, total = dev.mem_get_info()
    assert 0 < free <= total
    assert dev.memory_allocated() == 0
    dev.empty_cache()
    dev.synchronize()
    with dev.stream(dev.current_stream()):
        pass
    state = dev.get_rng_state()
    a = torch.rand(3)
    dev.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    with pytest.raises(AttributeError, match="stand-in for torch.cuda has no 'graph_pool_handle'"):
        dev.graph_pool_handle  # noqa: B018


def test_never_auto_detected_without_verl_platform(monkeypatch):
    from verl_modal.cpu.platform import PlatformCPU

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert PlatformCPU().is_platform_available(use_smi_check=True) is False
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert PlatformCPU().is_platform_available(use_smi_check=True) is True


@pytest.mark.slow
def test_verl_picks_it_through_its_own_external_module_hook():
    out = run_py(
        """
        from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name
        from verl.plugin.platform import get_platform
        from verl_modal.cpu import patches
        print(type(get_platform()).__name__, get_device_name(), get_nccl_backend(), get_resource_name())
        print(patches.installed())
        """,
        env=CPU_ENV,
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first == "PlatformCPU cpu gloo GPU"
    assert "'init_process_group': True" in second and "'vllm_hook': True" in second


@pytest.mark.slow
def test_other_platforms_untouched_without_verl_platform():
    out = run_py(
        """
        import verl_modal.cpu.platform
        from verl_modal.cpu import patches
        print(patches.installed()["init_process_group"], patches.installed()["vllm_hook"])
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_dedupe_backend():
    from verl_modal.cpu.patches import dedupe_backend

    assert dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedupe_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert dedupe_backend("cpu:gloo, cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert dedupe_backend("gloo") == "gloo"
    assert dedupe_backend(None) is None


INIT_PG = """
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
    import torch, torch.distributed as dist
    from verl.utils.distributed import initialize_global_process_group_ray
    initialize_global_process_group_ray(timeout_second=60)
    t = torch.ones(2)
    dist.all_reduce(t)
    print("ok", dist.get_backend(), t.tolist())
    dist.destroy_process_group()
"""


def _free_port() -> int:
    from modal_rl.cluster.ports import reserve

    return reserve(1)[0]


@pytest.mark.slow
def test_verl_process_group_comes_up_on_gloo_with_the_fix():
    out = run_py(INIT_PG.format(port=_free_port()), env=CPU_ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok cpu:gloo [1.0, 1.0]"


@pytest.mark.slow
def test_verl_process_group_fails_without_the_fix():
    # Blocker 3 as verl 0.9.1 hits it: the same env, our platform, but no backend de-dup.
    code = "import verl_modal.cpu.patches as p; p._patch_init_process_group = lambda: None\n"
    out = run_py(code + textwrap.dedent(INIT_PG.format(port=_free_port())), env=CPU_ENV)
    assert out.returncode != 0
    assert "Duplicate device type cpu" in out.stderr


@pytest.mark.slow
def test_vllm_extension_wrapped_when_verl_imports_it():
    # ... and the colocated sync goes in place: verl's extension has our rpc methods and
    # verl's ServerAdapter hands full-model updates to verl_modal.colocated_sync.
    out = run_py(
        """
        from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as ext
        from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter
        from verl_modal.cpu import patches
        print(patches.installed()["vllm_update_weights"], ext._update_weights.__name__)
        print(patches.installed()["vllm_colocated_inplace"], callable(ext.modal_rl_apply_weights),
              callable(ext.modal_rl_switch_weights), ServerAdapter.update_weights.__modal_rl_inplace__)
        """,
        env=CPU_ENV,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["True _update_weights", "True True True True"]


@pytest.mark.slow
def test_local_bring_up_is_loopback_only_with_logical_gpus():
    out = run_py(
        """
        from verl_modal.cpu import overrides as ov
        from modal_rl.run_temp import process_temp
        from verl_modal.runner import prepare_process_env, start_local_ray
        env = ov.worker_env()
        prepare_process_env(env)
        config = ov.compose(ov.cpu_overrides([], ["trainer.n_gpus_per_node=2", "ray_kwargs.ray_init.num_cpus=2"]))
        with process_temp():  # as runner.run brings it up: Ray's files in a run dir, removed
            start_local_ray(config, env)
            import ray

            @ray.remote(num_gpus=1)
            def probe():
                import os
                from verl.plugin.platform import get_platform
                return os.environ["VERL_PLATFORM"], type(get_platform()).__name__, ray.util.get_node_ip_address()

            print(sorted({n["NodeManagerAddress"] for n in ray.nodes()}), ray.cluster_resources()["GPU"])
            print(ray.get(probe.remote()))
            ray.shutdown()
        """,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    nodes, probe = out.stdout.strip().splitlines()[-2:]
    assert nodes == "['127.0.0.1'] 2.0"
    # The env reached a Ray worker through the runtime env, and verl there picked our platform.
    assert probe == "('cpu', 'PlatformCPU', '127.0.0.1')"


@pytest.mark.slow
def test_vllm_pause_generation_accepts_verls_keyword():
    # verl 0.9.1's vLLM server calls pause_generation(wait_for_inflight_requests=False, ...);
    # vllm-cpu 0.32.0 takes mode= only. The unwrapped signature refuses verl's call; the
    # wrapped one (installed on import where VERL_PLATFORM=cpu) maps it onto mode=.
    out = run_py(
        """
        import asyncio, inspect
        import verl  # the entry point installs the fixes, as in every verl process
        import vllm.v1.engine.async_llm as m
        from verl_modal.cpu import patches
        wrapped = m.AsyncLLM.pause_generation
        original = inspect.unwrap(wrapped)
        try:
            inspect.signature(original).bind(None, wait_for_inflight_requests=False)
            print("original accepts")
        except TypeError:
            print("original refuses")
        seen = []
        async def recording(self, *, mode="abort", clear_cache=True):
            seen.append((mode, clear_cache))
        shim = patches._accepting_wait_keyword(recording)
        asyncio.run(shim(None, wait_for_inflight_requests=False, clear_cache=False))
        asyncio.run(shim(None, wait_for_inflight_requests=True))
        asyncio.run(shim(None, mode="keep"))
        print(patches.installed()["vllm_pause_generation"], seen)
        """,
        env=CPU_ENV,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "original refuses"
    assert lines[-1] == "True [('abort', False), ('wait', True), ('keep', True)]"
