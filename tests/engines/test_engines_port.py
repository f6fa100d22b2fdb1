"""The Engine port: a third engine is one file and one registry entry, and the supervisor, the
pool and the health check drive it through the port alone (a real stand-in server process, real
HTTP with the engine bearer). vLLM's and SGLang's drivers build their launch commands in one
place each, and SGLang's catch-up (slime's disk reload) runs against a real server."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from modal_rl.engines import ENGINES, get_engine
from modal_rl.engines.pool import get_engine_pool
from modal_rl.engines.sglang import DiskReload, SglangEngine
from modal_rl.engines.supervisor import EngineSupervisor
from modal_rl.engines.vllm import LOCAL_SERVER, VllmEngine, VllmLoraEngine, local_vllm_spec, vllm_argv
from modal_rl.run_key import RUN_KEY_ENV, new_run_key
from modal_rl.weightsync.source import WeightSource

SERVER = str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py"))


@pytest.fixture
def key(monkeypatch) -> str:
    value = new_run_key()
    monkeypatch.setenv(RUN_KEY_ENV, value)
    return value


def records(state: Path, url: str) -> list[dict]:
    path = state / f"{url.rsplit(':', 1)[1]}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(events: list, kind: str, bound_s: float, after: int = 0) -> dict:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        found = [e for e in events[after:] if e["kind"] == kind]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {kind!r} event within {bound_s:.1f}s: {events[after:]}")


def test_the_registry_names_every_engine_and_refuses_an_unknown_one_in_one_line():
    assert {"vllm", "vllm-lora", "sglang"} <= set(ENGINES.names())
    assert ENGINES.load("vllm") is VllmEngine and ENGINES.load("sglang") is SglangEngine
    with pytest.raises(ValueError, match=r"^unknown engine 'tgi'; known: \[") as info:
        get_engine("tgi")
    assert "\n" not in str(info.value)


def test_a_third_engine_registered_by_name_is_driven_through_the_port(tmp_path, key):
    ENGINES.add("stand-in", "tests.stand_in_engine:StandInEngine")  # the one registry line
    engine = get_engine("stand-in", key=key, state=str(tmp_path), catch_up_to=7)
    pool = get_engine_pool(engine.spec(), "local", log_dir=str(tmp_path / "logs"))
    sup = EngineSupervisor(pool, engine, interval_s=0.2, probe_timeout_s=2.0, failures=2)
    with sup:
        (url,) = sup.pool.addresses
        assert engine.health(url, 2.0)[0]  # the port's check: a keyed 1-token generation
        sup.set_source(WeightSource("127.0.0.1", 1, version=3))
        assert sup.acquire(1.0).version == 3
        loads = [r for r in records(tmp_path, url) if r["path"] == "/collective_rpc"]
        assert [(r["body"]["version"], r["refused"]) for r in loads] == [(3, False)]
        with pytest.raises(
            NotImplementedError, match=r"engine 'stand-in' \(StandInEngine\) does not support pause"
        ):
            engine.pause(url)

        mark = len(sup.events)
        os.killpg(pool.pid(0), signal.SIGKILL)
        caught = wait_for(sup.events, "caught_up", 30.0, mark)
        wait_for(sup.events, "serving", 30.0, mark)
        new_url = sup.acquire(5.0).url
        assert new_url != url and caught["weight_version"] == 7
        # the replacement: caught up through the port, then loaded the current version, then served
        seen = [(r["path"], r["body"]) for r in records(tmp_path, new_url) if r["method"] == "POST"]
        posts = [p for p in seen if p[0] != "/v1/completions"]
        assert posts == [("/catch_up", {"version": 7}), ("/collective_rpc", {"method": "load", "version": 3})]


def test_vllm_commands_come_from_one_builder_and_carry_no_key(key):
    engine = VllmEngine("m", key=key, served_name="served")
    argv = engine.argv()
    assert argv[: len(LOCAL_SERVER) + 5] == [*LOCAL_SERVER, "m", "--host", "{host}", "--port", "{port}"]
    assert argv[argv.index("--middleware") + 1] == "modal_rl.engines.auth.RunKeyAuth"
    assert argv[-2:] == [
        "--worker-extension-cls",
        "modal_rl.weightsync.apply.vllm_extension.DeltaWeightsExtension",
    ]
    assert engine.generate_request()["body"]["model"] == "served"
    assert key not in " ".join(argv)
    spec = local_vllm_spec("/models/tiny", dtype="float32", max_model_len=64)
    flags = ["--enforce-eager", "--max-model-len", "64", "--max-num-seqs", "4", "--block-size", "32"]
    want = vllm_argv(
        LOCAL_SERVER, "/models/tiny", dtype="float32", seed=0, flags=flags, receives_weights=True
    )
    assert list(spec.command) == want and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert spec.generate["body"]["model"] == "/models/tiny"


def test_capabilities_an_engine_lacks_name_the_engine(key):
    sglang = SglangEngine("m", key=key)
    for call in (lambda: sglang.pause("http://127.0.0.1:1"), lambda: sglang.load_adapter("u", "a", "/p")):
        with pytest.raises(NotImplementedError, match=r"^engine 'sglang' \(SglangEngine\) does not support "):
            call()
    lora = VllmLoraEngine({"prefix": "p", "max_resident": 2, "config": {}}, key=key)
    with pytest.raises(NotImplementedError, match="'vllm-lora'.*LoRA adapters: use load"):
        lora.stage("http://127.0.0.1:1", WeightSource("127.0.0.1", 1, version=1))


@pytest.mark.parametrize("local_checkpoint", [True, False], ids=["local-checkpoint", "version-dir"])
def test_sglang_catch_up_reloads_the_newest_version_as_slime_does(tmp_path, key, local_checkpoint):
    newest = {"version": 0}
    engine = SglangEngine(
        "/models/m",
        key=key,
        server=(sys.executable, SERVER, "--require-key", "--state", str(tmp_path)),
        reload=DiskReload(
            lambda: (newest["version"], f"/disk/weight_v{newest['version']:06d}"),
            "/disk",
            "/ckpt" if local_checkpoint else None,
        ),
        timeout_s=10.0,
    )
    argv = engine.argv()
    assert argv[argv.index("--model-path") + 1] == "/models/m" and key not in " ".join(argv)
    pool = get_engine_pool(engine.spec(), "local", log_dir=str(tmp_path / "logs"))
    with pool as (url,):
        assert engine.catch_up(url)["weight_version"] == 0  # nothing published: nothing sent
        newest["version"] = 4
        assert engine.catch_up(url)["weight_version"] == 4
        sent = [(r["path"], r["body"], r["refused"]) for r in records(tmp_path, url) if r["method"] == "POST"]
        sent = [s for s in sent if s[0] != "/generate"]  # the pool's health probes
    reload = (
        "/update_weights_from_disk",
        {"model_path": "/ckpt" if local_checkpoint else "/disk/weight_v000004"},
    )
    reload[1]["weight_version"] = "4"
    want = [(*reload, False)]
    if local_checkpoint:
        pull = {"local_checkpoint_dir": "/ckpt", "source_dir": "/disk", "target_version": 4}
        want.insert(0, ("/pull_weights", pull, False))
    assert sent == want
