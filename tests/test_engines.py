"""EnginePool: the local pool against a real HTTP server process; the Modal pool's spec offline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from modal_rl.cluster import procs
from modal_rl.cluster.engines import EngineSpec, EngineStartError, LocalEnginePool, probe, running
from modal_rl.cluster.spec import ClusterSpecError

SERVER = str(Path(__file__).with_name("_engine_server.py"))


def fake_spec(tmp_path, count=2, mode="ok", extra=(), **kw) -> EngineSpec:
    command = [sys.executable, SERVER, "--host", "{host}", "--port", "{port}", "--mode", mode]
    return EngineSpec(command=[*command, "--state", str(tmp_path), *extra], count=count, **kw)


def get(url: str) -> int:
    ok, what = probe(url, timeout_s=5)
    return 200 if ok else what


def test_local_pool_starts_serves_and_leaves_nothing(tmp_path):
    pool = LocalEnginePool(
        fake_spec(tmp_path, count=2, extra=["--setsid-child"]), log_dir=str(tmp_path / "logs")
    )
    with pool as addresses:
        assert len(addresses) == 2 and len(set(addresses)) == 2
        assert all(a.startswith("http://127.0.0.1:") for a in addresses)
        assert [get(a + "/health") for a in addresses] == [200, 200]
        pids = [p.pid for p in pool.procs]
        # Each server forked a `sleep` into its own session: outside the process group.
        assert len(procs.pids_of_run(pool.run_id)) >= 4
    assert procs.alive(pids) == []
    assert procs.pids_of_run(pool.run_id) == []
    assert "fake engine starting" in (tmp_path / "logs" / "engine-0.log").read_text()


def test_one_engine_exiting_at_start_stops_the_others(tmp_path):
    pool = LocalEnginePool(fake_spec(tmp_path, count=3, mode="crash-first"))
    with pytest.raises(EngineStartError) as info:
        pool.start()
    text = str(info.value)
    assert "exited with code 3 before it was healthy" in text
    assert "could not load model weights" in text  # its last log lines
    assert pool.procs == [] and procs.pids_of_run(pool.run_id) == []


def test_health_timeout_names_engine_and_stops_all(tmp_path):
    spec = fake_spec(tmp_path, count=2, mode="hang", startup_timeout_s=1.5)
    with pytest.raises(EngineStartError) as info, running(spec, "local"):
        pass
    text = str(info.value)
    assert text.startswith("engine 0 did not answer GET /health within 1.5 s")
    assert "loading model ..." in text


def test_keyboard_interrupt_in_body_stops_engines(tmp_path):
    pool = LocalEnginePool(fake_spec(tmp_path, count=1))
    with pytest.raises(KeyboardInterrupt), pool:
        pids = [p.pid for p in pool.procs]
        raise KeyboardInterrupt
    assert procs.alive(pids) == [] and procs.pids_of_run(pool.run_id) == []
    pool.stop()  # idempotent


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"command": []}, "command is empty"),
        ({"count": 0}, "count=0"),
        ({"gpu": "Z80:1"}, "unknown GPU type"),
        ({"health_path": "health"}, "must start with '/'"),
        ({"count": 3, "max_containers": 2}, "every engine needs a container"),
        ({"min_containers": 5, "count": 2}, "min_containers=5"),
        ({"serve_timeout_s": 10 * 24 * 3600}, "at most 24 h"),
        ({"env": {"1X": "y"}}, "shell identifier"),
        ({"secrets": ["bad name"]}, "engine secret name"),
    ],
)
def test_spec_validation(kwargs, needle):
    base = {"command": ["x", "--port", "{port}"]}
    with pytest.raises(ClusterSpecError, match=needle):
        EngineSpec(**{**base, **kwargs})


def test_spec_argv_and_roundtrip():
    spec = EngineSpec(command=["serve", "--host", "{host}", "--port", "{port}"], count=2, env={"A": 1})
    assert spec.argv("0.0.0.0", 9) == ["serve", "--host", "0.0.0.0", "--port", "9"]
    assert EngineSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.max_containers == 2 and spec.env == {"A": "1"}


def modal_closure(fn) -> dict:
    inner = next((v for k, v in vars(fn).items() if k.startswith("_sync_original")), fn)
    return dict(
        zip(inner._load.__code__.co_freevars, [c.cell_contents for c in inner._load.__closure__], strict=True)
    )


def test_modal_engine_function_spec_offline():
    from modal_rl.cluster.engines_modal import ModalEnginePool, build_function, engine_container_main

    spec = EngineSpec(
        command=["vllm", "serve", "Qwen/Qwen3-0.6B", "--host", "{host}", "--port", "{port}"],
        count=3,
        gpu="H100:1",
        image="vllm/vllm-openai:v0.12.0",
        volumes={"hf-cache": "/root/.cache/huggingface"},
        startup_timeout_s=600,
        serve_timeout_s=7200,
        min_containers=1,
    )
    app, fn = build_function(spec)
    cells = modal_closure(fn)
    assert app.name == "modal-rl-engines"
    assert cells["gpu"] == "H100:1"
    assert cells["timeout"] == 7200 and cells["startup_timeout"] == 600
    assert cells["max_containers"] == 3 and cells["min_containers"] == 1
    assert cells["cluster_size"] is None  # not a clustered function: engines scale on their own
    assert cells["info"].raw_f is engine_container_main
    plan = ModalEnginePool(spec).describe()
    assert plan["commands"][0][-4:] == ["--host", "0.0.0.0", "--port", "8000"]
    assert plan["modal_function"]["inspected"]["volumes"] == {"/root/.cache/huggingface": "hf-cache"}


def test_modal_pool_needs_an_image():
    from modal_rl.cluster.engines_modal import build_function

    with pytest.raises(ValueError, match="needs an image"):
        build_function(EngineSpec(command=["x"], gpu="H100:1"))


@pytest.mark.modal_live
@pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="needs MODAL_TOKEN_ID")
def test_modal_engines_live():
    """Two CPU containers running Python's http.server; reachable through their tunnels."""
    spec = EngineSpec(
        command=["python", "-m", "http.server", "{port}", "--bind", "{host}"],
        count=2,
        image="python:3.11-slim",
        health_path="/",
        startup_timeout_s=300,
        serve_timeout_s=600,
    )
    with running(spec, "modal") as addresses:
        assert len(addresses) == 2
        assert [get(a + "/") for a in addresses] == [200, 200]


def test_engines_outlive_the_thread_that_started_them(tmp_path):
    """The parent-death signal is per thread: a pool started from a short-lived thread keeps
    its engines (they are forked by the spawner thread) until it is stopped."""
    import threading
    import time

    pool = LocalEnginePool(fake_spec(tmp_path, count=1))
    starter = threading.Thread(target=pool.start)
    starter.start()
    starter.join()
    try:
        time.sleep(0.5)
        assert pool.procs[0].poll() is None
        assert get(pool.addresses[0] + "/health") == 200
    finally:
        pool.stop()
    assert procs.pids_of_run(pool.run_id) == []
