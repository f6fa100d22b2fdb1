"""``modal_vllm`` rollout replica: real verl classes and config, the engine spec it would deploy,
and a local engine (a real HTTP server process) behind a real Ray proxy actor."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.verl_plugin_helpers import plugin_env, run_python

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).resolve().parents[1].joinpath("_engine_server.py")
EXTENSION = "modal_rl.weightsync.apply.vllm_extension.DeltaWeightsExtension"
MODEL = "Qwen/Qwen3-0.6B"


def compose(*extra: str):
    from verl_modal.cpu.overrides import compose as verl_compose

    return verl_compose(
        [
            "actor_rollout_ref.rollout.name=modal_vllm",
            f"actor_rollout_ref.model.path={MODEL}",
            "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def config():
    return compose()


@pytest.fixture(scope="module")
def replica_cls():
    from verl.workers.rollout.replica import get_rollout_replica_class

    import verl_modal._replica_register  # noqa: F401 - what the entry point runs

    return get_rollout_replica_class("modal_vllm")


def make(replica_cls, config, rank=0):
    rollout = config.actor_rollout_ref.rollout
    # As verl's LLMServerManager builds them.
    return replica_cls(
        replica_rank=rank,
        config=rollout,
        model_config=config.actor_rollout_ref.model,
        gpus_per_node=rollout.n_gpus_per_node,
    )


def test_registry_lookup_by_name(replica_cls):
    from verl.workers.rollout.replica import RolloutReplica

    from verl_modal.replica import ModalVLLMReplica

    assert replica_cls is ModalVLLMReplica and issubclass(replica_cls, RolloutReplica)


def test_engine_spec_from_verl_config(replica_cls, config, monkeypatch):
    monkeypatch.setenv("VERL_MODAL_ENGINE_GPU", "H200")
    monkeypatch.setenv("VERL_MODAL_ENGINE_VOLUMES", "hf-cache:/root/.cache/huggingface")
    spec = make(replica_cls, config).engine_spec()
    cmd = list(spec.command)
    assert cmd[:3] == ["vllm", "serve", MODEL]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"  # prompt 512 + response 512
    assert "--enable-sleep-mode" in cmd  # free_cache_engine defaults to True
    assert spec.gpu == "H200:2" and spec.count == 1 and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    # Weights come from the trainer: verl's default dummy load, plus our weight-pull extension
    # (and what it needs in the image).
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    # (and what it needs in the image: pyproject's engine-receiver extra; numba decodes v2 chunks; cryptography checks the trainer's signatures)
    assert {p.split(">=")[0] for p in spec.pip} == {"numpy", "zstandard", "xxhash", "numba", "cryptography"}

    from modal_rl.cluster.backend_modal import inspect_function
    from modal_rl.engines.pool_modal import build_function

    assert cmd[cmd.index("--middleware") + 1] == "modal_rl.engines.auth.RunKeyAuth"
    assert spec.auth == "bearer"  # the pool hands the engine the run key (never in the spec)

    _, fn = build_function(spec, key="k")
    inspected = inspect_function(fn)
    assert inspected["gpu"] == "H200:2"
    assert inspected["volumes"] == {"/root/.cache/huggingface": "hf-cache"}


def test_rollout_batching_settings_reach_the_engines_vllm(replica_cls):
    """``rollout.max_num_seqs`` sets how many requests the engine decodes at once (the async
    e2e run relies on it to make a batch decode in waves)."""
    config = compose(
        "actor_rollout_ref.rollout.max_num_seqs=3", "actor_rollout_ref.rollout.max_num_batched_tokens=640"
    )
    cmd = list(make(replica_cls, config).engine_spec().command)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "3"
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "640"


def test_engine_cores_bind_the_local_engines_processes_and_threads(replica_cls, config, monkeypatch):
    """``cpus`` keeps a local engine on its cores (so a trainer on the same host keeps the
    others): the pool starts it there, and vLLM's CPU backend binds its threads there."""
    spec = make(replica_cls, config).engine_spec()
    assert spec.cpus == () and "VLLM_CPU_OMP_THREADS_BIND" not in spec.env
    monkeypatch.setenv("VERL_MODAL_ENGINE_CPUS", "1")
    spec = make(replica_cls, config).engine_spec()
    assert spec.cpus == (1,) and spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    config = compose("+actor_rollout_ref.rollout.custom={modal_engines:{cpus:'0-1,3'}}")
    spec = make(replica_cls, config).engine_spec()
    assert spec.cpus == (0, 1, 3) and spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,3"
    assert round_trip(spec).cpus == (0, 1, 3)
    monkeypatch.setenv("VERL_MODAL_ENGINE_CPUS", "one")
    from modal_rl.cluster.spec import ClusterSpecError

    with pytest.raises(ClusterSpecError, match="name cores like"):
        make(replica_cls, compose()).engine_spec()


def round_trip(spec):
    from modal_rl.engines.pool import EngineSpec

    return EngineSpec.from_dict(json.loads(json.dumps(spec.to_dict())))


def test_custom_config_wins_over_env_and_bad_settings_are_refused(replica_cls, monkeypatch):
    monkeypatch.setenv("VERL_MODAL_ENGINE_GPU", "H200")
    config = compose("+actor_rollout_ref.rollout.custom={modal_engines:{gpu:A100-80GB}}")
    assert make(replica_cls, config).engine_spec().gpu == "A100-80GB:2"
    monkeypatch.setenv("VERL_MODAL_ENGINE_BACKEND", "kubernetes")
    with pytest.raises(ValueError, match="choose 'modal' or 'local'"):
        make(replica_cls, config)


def test_a_reward_model_replica_keeps_its_weights(replica_cls, config):
    rollout = config.actor_rollout_ref.rollout
    replica = replica_cls(
        replica_rank=0,
        config=rollout,
        model_config=config.actor_rollout_ref.model,
        gpus_per_node=rollout.n_gpus_per_node,
        is_reward_model=True,
    )
    spec = replica.engine_spec()
    assert not replica.receives_weights
    assert "--worker-extension-cls" not in spec.command and spec.pip == ()


def test_a_checkpoint_engine_that_cannot_reach_the_engine_is_refused_before_it_starts(replica_cls, config):
    # verl's default backend (naive) never reaches a standalone replica; nccl needs a GPU the
    # relay worker does not have. Refused before any engine is started (no Ray needed).
    replica = make(replica_cls, config)
    with pytest.raises(ValueError, match="checkpoint_engine.backend=modal_delta"):
        asyncio.run(replica.init_standalone())
    assert not replica.proxy_started


def test_hybrid_mode_is_refused_with_the_way_out(replica_cls, config):
    with pytest.raises(RuntimeError, match="hybrid_engine=False"):
        asyncio.run(make(replica_cls, config).init_hybrid(None))


def test_multi_node_replica_is_refused(replica_cls):
    config = compose("actor_rollout_ref.rollout.n_gpus_per_node=1")
    with pytest.raises(ValueError, match="spans 2 nodes"):
        make(replica_cls, config)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    from modal_rl.run_key import RUN_KEY_ENV, new_run_key
    from tests._local_ray import loopback_ray

    # As a launcher leaves it: the run key in this process and so in every Ray worker.
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    with loopback_ray(tmp_path_factory, 1, {"PYTHONPATH": str(ROOT)}) as ray:
        yield ray


@pytest.mark.slow
def test_local_engine_launch_generate_and_control(replica_cls, local_ray, tmp_path, monkeypatch):
    from modal_rl.cluster import procs

    monkeypatch.setenv("VERL_MODAL_ENGINE_BACKEND", "local")
    # The stand-in engine refuses every request without the run key (but GET /health).
    monkeypatch.setenv(
        "VERL_MODAL_ENGINE_SERVER", f"{sys.executable} {SERVER} --state {tmp_path} --require-key"
    )
    replica = make(replica_cls, compose("actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta"))

    async def scenario():
        await replica.init_standalone()
        host, port = replica.server_address.split(":")
        assert host == "127.0.0.1" and replica.server_handle is replica.servers[0]
        out = await replica.server_handle.generate.remote(
            prompt_ids=[5, 6, 7], sampling_params={"temperature": 0.7, "logprobs": True}, request_id="r1"
        )
        await replica.sleep()
        await replica.wake_up()
        await replica.abort_all_requests()
        await replica.resume_generation()
        await replica.clear_kv_cache()
        (pid,) = await replica.engine_pids()
        (relay,) = replica.workers  # the CPU worker verl's CheckpointEngineManager updates
        assert await relay.get_replica_rank.remote() == 0
        await replica.shutdown()
        return out, int(port), pid

    out, port, pid = asyncio.run(scenario())
    assert out.token_ids == [6, 7, 8] and out.log_probs == [-0.5] * 3 and out.stop_reason == "completed"
    seen = [json.loads(line) for line in (tmp_path / f"{port}.jsonl").read_text().splitlines()]
    assert seen and not [r for r in seen if r["refused"]]  # every call carried the key
    posts = [r for r in seen if r["method"] == "POST" and not is_probe(r)]
    assert [r for r in seen if is_probe(r)]  # health = a keyed 1-token generation
    completion = posts[0]["body"]
    assert posts[0]["path"] == "/v1/completions"
    assert completion["model"] == MODEL and completion["prompt"] == [5, 6, 7]
    assert completion["max_tokens"] == 512 and completion["logprobs"] == 0 and completion["return_token_ids"]
    # after an answer the proxy reads that request's version record from the engine's ledger
    # (verl_modal.replica_proxy); the stand-in keeps none, which costs the sample its record only
    assert posts[1]["path"] == "/collective_rpc" and posts[1]["body"]["method"] == "modal_rl_versions"
    assert [r["path"] for r in posts[2:]] == [
        "/sleep?level=1",
        "/wake_up",
        "/pause?clear_cache=true",
        "/resume",
        "/reset_prefix_cache",
    ]
    assert procs.alive([pid]) == []


def is_probe(record: dict) -> bool:
    from modal_rl.engines.health import PROBE_ID_PREFIX

    return str((record["body"] or {}).get("request_id", "")).startswith(PROBE_ID_PREFIX)


@pytest.mark.slow
def test_a_killed_engine_is_replaced_and_a_request_on_a_hung_one_is_masked(
    replica_cls, local_ray, tmp_path, monkeypatch
):
    """Through verl's replica and the proxy actor: SIGKILL the engine, the next request is
    answered by its replacement; SIGSTOP it with no time to wait for a replacement, and the
    request comes back as a masked sample (no tokens, "aborted", the reason), not an error."""
    import signal

    from modal_rl.cluster import procs
    from verl_modal.replica_proxy import MASKED, WEIGHT_VERSION

    monkeypatch.setenv("VERL_MODAL_ENGINE_BACKEND", "local")
    monkeypatch.setenv(
        "VERL_MODAL_ENGINE_SERVER", f"{sys.executable} {SERVER} --state {tmp_path} --require-key"
    )
    monkeypatch.setenv("VERL_MODAL_ENGINE_HEALTH_INTERVAL_S", "0.2")
    monkeypatch.setenv("VERL_MODAL_ENGINE_HEALTH_TIMEOUT_S", "1")
    monkeypatch.setenv("VERL_MODAL_ENGINE_HEALTH_FAILURES", "2")
    monkeypatch.setenv("VERL_MODAL_ENGINE_RETRY_WAIT_S", "0.01")
    # Rank 1, and no relay worker (a reward-model replica keeps its weights): the other test's
    # relay holds this one-CPU Ray session's CPU and its placement group's name.
    config = compose("actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta")
    rollout = config.actor_rollout_ref.rollout
    replica = replica_cls(
        replica_rank=1,
        config=rollout,
        model_config=config.actor_rollout_ref.model,
        gpus_per_node=rollout.n_gpus_per_node,
        is_reward_model=True,
    )
    ask = {"prompt_ids": [5, 6, 7], "sampling_params": {"temperature": 0.7}, "request_id": "r"}

    async def scenario():
        await replica.init_standalone()
        proxy = replica.server_handle
        (first,) = await replica.engine_pids()
        os.kill(first, signal.SIGKILL)
        for _ in range(1200):  # the replacement serves (slow only on a loaded host)
            if [e for e in await replica.engine_events() if e["kind"] == "serving"]:
                break
            await asyncio.sleep(0.1)
        served = await proxy.generate.remote(**ask)
        (second,) = await replica.engine_pids()
        os.kill(second, signal.SIGSTOP)
        masked = await proxy.generate.remote(**ask)
        events, stats = await replica.engine_events(), await proxy.request_stats.remote()
        await replica.shutdown()
        return first, second, served, masked, events, stats

    first, second, served, masked, events, stats = asyncio.run(scenario())
    assert second != first and served.token_ids == [6, 7, 8]
    assert served.extra_fields[MASKED] is None and WEIGHT_VERSION in served.extra_fields
    assert masked.token_ids == [] and masked.stop_reason == "aborted"
    assert "no engine serves the current weights" in masked.extra_fields[MASKED]
    assert stats["masked"] == 1 and stats["requests"] == 2
    assert [e["kind"] for e in events][:4] == ["started", "lost", "replaced", "serving"]
    assert events[1]["pid"] == first and procs.alive([first, second]) == []


def test_entry_point_registers_modal_vllm_lazily(tmp_path):
    out = run_python(
        """
        import sys
        import verl
        from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class
        assert "modal_vllm" in RolloutReplicaRegistry._registry
        assert "verl_modal.replica" not in sys.modules  # registration imports nothing heavy of ours
        print(get_rollout_replica_class("modal_vllm").__module__)
        """,
        plugin_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "verl_modal.replica"


def test_a_registration_failure_is_logged_at_error(monkeypatch, caplog):
    import verl_modal._replica_register as reg

    monkeypatch.setitem(sys.modules, reg.TARGET, object())  # a replica module without the registry
    with caplog.at_level("ERROR", logger="verl_modal"):
        reg.register()
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "could not register rollout replica 'modal_vllm'" in caplog.text


@pytest.mark.modal_live
@pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="needs MODAL_TOKEN_ID")
def test_modal_engine_live(replica_cls, local_ray, monkeypatch):
    """One real vLLM engine on a Modal L4 serving a 0.5B model, reached through its tunnel."""
    monkeypatch.setenv("VERL_MODAL_ENGINE_GPU", "L4")
    monkeypatch.setenv("VERL_MODAL_ENGINE_IMAGE", "vllm/vllm-openai:v0.12.0")
    # No weight update is pushed here (that needs the relay inside a Modal container, where its
    # frame server gets a tunnel), so the engine loads the real weights itself.
    monkeypatch.setenv("VERL_MODAL_ENGINE_WEIGHTS_EXPOSE", "local")
    config = compose(
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.load_format=auto",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta",
    )
    replica = make(replica_cls, config)

    async def scenario():
        await replica.init_standalone()
        try:
            return await replica.server_handle.generate.remote(
                prompt_ids=[9707, 11, 1879],
                sampling_params={"max_tokens": 8, "logprobs": True},
                request_id="live",
            )
        finally:
            await replica.shutdown()

    out = asyncio.run(scenario())
    assert 1 <= len(out.token_ids) <= 8 and len(out.log_probs) == len(out.token_ids)
