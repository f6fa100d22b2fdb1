"""EnginePool: the local pool against a real HTTP server process; the Modal pool's spec offline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from modal_rl.cluster import procs
from modal_rl.cluster.spec import ClusterSpecError
from modal_rl.engines.health import probe
from modal_rl.engines.pool import EngineSpec, EngineStartError, running
from modal_rl.engines.pool_local import LocalEnginePool
from modal_rl.modal_calls import inspect_function
from modal_rl.run_key import (
    FRAME_READ_ENV,
    RAY_TOKEN_ENV,
    RUN_KEY_ENV,
    engine_bearer,
    engine_env,
    frame_read_key,
    new_run_key,
    ray_token,
)

SERVER = str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py"))


@pytest.fixture(autouse=True)
def key(monkeypatch) -> str:
    """As a launcher leaves it: the run key in this process's environment."""
    value = new_run_key()
    monkeypatch.setenv(RUN_KEY_ENV, value)
    monkeypatch.setenv(RAY_TOKEN_ENV, value)
    return value


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
        ({"env": {"MODAL_RL_RUN_KEY": "k"}}, "gives engines the run key itself"),
        ({"env": {"RAY_AUTH_TOKEN": "k"}}, "gives engines the run key itself"),
        ({"auth": "basic"}, "choose 'bearer' or None"),
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
    assert spec.auth == "bearer"  # keyed unless a caller says otherwise


def records(tmp_path, port: int) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"{port}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("pulls_frames", [True, False])
def test_an_engine_gets_the_frame_read_key_only_if_it_pulls_frames(tmp_path, key, pulls_frames):
    """Least privilege: an engine that pulls no modal_rl frames (SGLang's) holds its bearer
    alone; one that does (vLLM with our extension) also the frame-read key."""
    import dataclasses

    spec = dataclasses.replace(fake_spec(tmp_path, count=1), pulls_frames=pulls_frames)
    assert (FRAME_READ_ENV in engine_env(key, pulls_frames)) is pulls_frames
    pool = LocalEnginePool(spec, log_dir=str(tmp_path / "logs"))
    with pool:
        environ = Path(f"/proc/{pool.procs[0].pid}/environ").read_bytes()
        assert engine_bearer(key).encode() in environ
        assert (frame_read_key(key).encode() in environ) is pulls_frames
        assert (FRAME_READ_ENV.encode() + b"=" in environ) is pulls_frames


def test_keyed_engines_get_the_key_in_their_env_and_health_checks_send_it(tmp_path, key):
    """A server that refuses everything without the key (but GET /health) comes up, because
    the pool gave it the key through its environment; requests without the key are refused."""
    pool = LocalEnginePool(
        fake_spec(tmp_path, count=1, extra=["--require-key"]), log_dir=str(tmp_path / "logs")
    )
    with pool as (address,):
        ok, what = probe(address + "/server_info", key=key)
        assert ok, what
        assert probe(address + "/server_info") == (False, "HTTP 401")
        assert probe(address + "/server_info", key=new_run_key()) == (False, "HTTP 401")
        got = records(tmp_path, pool.ports[0])
        assert [r["refused"] for r in got if r["path"] == "/server_info"] == [False, True, True]
        log = pool.log_path(0).read_text()
        # The engine holds its bearer, never the run key (round 3: capabilities, not a secret).
        assert "engine bearer in env: yes" in log and "run key in env: no" in log
        environ = Path(f"/proc/{pool.procs[0].pid}/environ").read_bytes()
        assert key.encode() not in environ and engine_bearer(key).encode() in environ
        assert ray_token(key).encode() not in environ
        with open(f"/proc/{pool.procs[0].pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()  # on no command line
    assert key not in json.dumps(pool.describe())
    assert "bearer key required" in pool.describe()["auth"]


def test_no_run_key_no_keyed_engine(tmp_path, monkeypatch):
    monkeypatch.delenv(RUN_KEY_ENV)
    pool = LocalEnginePool(fake_spec(tmp_path, count=2))
    with pytest.raises(EngineStartError) as info:
        pool.start()
    text = str(info.value)
    assert text.startswith("engine: its server needs the run key (auth='bearer'); no run key:")
    assert "\n" not in text and pool.procs == []


def test_a_keyless_engine_gets_no_key(tmp_path, key):
    pool = LocalEnginePool(fake_spec(tmp_path, count=1, auth=None), log_dir=str(tmp_path / "logs"))
    with pool:
        environ = Path(f"/proc/{pool.procs[0].pid}/environ").read_bytes()
        assert key.encode() not in environ
    assert "engine bearer in env: no" in pool.log_path(0).read_text()
    assert "keyless" in pool.describe()["auth"]


def test_probe_sends_the_key_only_over_tls_or_to_loopback(key):
    ok, what = probe("http://10.255.255.1:9/health", timeout_s=0.2, key=key)
    assert not ok and what == "not sent: the run key goes only over https or to loopback"


def test_an_engine_log_tail_never_shows_the_key(tmp_path, key):
    # A server that prints its environment (as a misconfigured one might) and dies.
    spec = EngineSpec(
        command=[
            sys.executable,
            "-c",
            "import os,sys; print(os.environ['MODAL_RL_ENGINE_BEARER']); sys.exit(4)",
        ]
    )
    with pytest.raises(EngineStartError) as info:
        LocalEnginePool(spec).start()
    assert "exited with code 4" in str(info.value) and engine_bearer(key) not in str(info.value)
    assert "<redacted>" in str(info.value)


def test_modal_engine_function_spec_offline(key):
    from modal_rl.engines.pool_modal import ModalEnginePool, build_function, engine_container_main

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
    app, fn = build_function(spec, key=key)
    passed = inspect_function(fn)  # what Modal's public app.function was handed
    assert app.name == "modal-rl-engines"
    assert passed["gpu"] == "H100:1"
    settings = passed["settings"]
    assert settings["timeout"] == 7200 and settings["startup_timeout"] == 600
    assert settings["max_containers"] == 3 and settings["min_containers"] == 1
    assert passed["cluster_size"] is None  # not a clustered function: engines scale on their own
    assert passed["body"] == engine_container_main.__qualname__
    plan = ModalEnginePool(spec).describe()
    assert plan["commands"][0][-4:] == ["--host", "0.0.0.0", "--port", "8000"]
    assert plan["modal_function"]["inspected"]["volumes"] == {"/root/.cache/huggingface": "hf-cache"}
    assert plan["auth"].startswith("TLS tunnel (modal.forward, https:// address), bearer key required")
    assert plan["reachable_as"].startswith("https://")
    # the run's secret, described by its variable names only
    assert plan["modal_function"]["inspected"]["secrets"] == [
        "Secret.from_dict([MODAL_RL_ENGINE_BEARER, MODAL_RL_FRAME_READ_KEY])"
    ]


def test_modal_engine_function_carries_the_run_key_as_a_secret_only(key):
    from modal_rl.engines.pool_modal import ModalEnginePool, build_function

    spec = EngineSpec(
        command=["vllm", "serve", "m", "--port", "{port}"],
        gpu="H100:1",
        image="vllm/vllm-openai:v0.12.0",
        secrets=["hf-token"],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    _, fn = build_function(spec, key=key)
    # The plain env travels as env; the key only in the run's secret, described by names.
    passed = inspect_function(fn)
    assert passed["secrets"] == [
        "Secret.from_name('hf-token')",
        f"Secret.from_dict([{', '.join(engine_env(key))}])",
    ]
    assert not any(RUN_KEY_ENV in s or RAY_TOKEN_ENV in s for s in passed["secrets"])  # no run key
    assert passed["env"] == ["VLLM_SERVER_DEV_MODE"]
    with pytest.raises(ValueError, match="needs the run key"):
        build_function(spec)
    # Keyless: no run secret at all.
    _, fn = build_function(EngineSpec(command=["x"], gpu="H100:1", image="python:3.11", auth=None))
    assert inspect_function(fn)["secrets"] == []
    # The dry run: no key anywhere in it (a placeholder stands in for the secret).
    plan = ModalEnginePool(spec).describe()
    assert key not in json.dumps(plan) and len(plan["modal_function"]["inspected"]["secrets"]) == 2
    assert key not in json.dumps(spec.to_dict())


def test_modal_pool_start_needs_the_run_key(monkeypatch):
    from modal_rl.engines.pool_modal import ModalEnginePool

    monkeypatch.delenv(RUN_KEY_ENV)
    pool = ModalEnginePool(EngineSpec(command=["x"], gpu="H100:1", image="python:3.11"))
    with pytest.raises(EngineStartError, match="needs the run key"):
        pool.start()  # before anything contacts Modal


def test_modal_pool_needs_an_image():
    from modal_rl.engines.pool_modal import build_function

    with pytest.raises(ValueError, match="needs an image"):
        build_function(EngineSpec(command=["x"], gpu="H100:1"), key="k")


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
        auth=None,  # python's http.server takes no key
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


def test_a_bare_program_is_this_environments_and_a_missing_one_is_one_line(tmp_path, monkeypatch):
    """A venv that was never activated is not on PATH: ``python3`` (or ``vllm``) must still be
    the environment's own, and a program that is nowhere fails before anything starts."""
    from modal_rl.engines.pool_local import program

    own_bin = Path(sys.executable).parent
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as a shell that never activated the venv
    assert program(Path(sys.executable).name, os.environ["PATH"]) == str(own_bin / Path(sys.executable).name)
    assert program("sh", os.environ["PATH"]) in ("/usr/bin/sh", "/bin/sh")  # not ours: from PATH
    assert program("/abs/path/x", None) == "/abs/path/x"
    spec = EngineSpec(command=["no-such-engine-program", "serve", "--port", "{port}"], name="vllm-replica-0")
    pool = LocalEnginePool(spec, log_dir=str(tmp_path / "logs"))
    with pytest.raises(EngineStartError) as err:
        pool.start()
    line = str(err.value)
    assert "\n" not in line and "'no-such-engine-program'" in line and str(own_bin) in line
    assert line.startswith("vllm-replica-0: ") and not pool.temp_dir.exists()


def test_a_remote_engine_start_error_reaches_the_user_as_its_own_line():
    """Ray wraps an actor's exception as ``RayTaskError(EngineStartError)`` whose text is the
    remote traceback; the launcher's line is the cause's own message."""
    from modal_rl.cli_errors import describe

    cause = EngineStartError("vllm-replica-0: its command's program 'vllm' is nowhere")
    wrapper = type("RayTaskError(EngineStartError)", (EngineStartError,), {})(
        "ray::VLLMHttpProxy.start() (pid=1, ip=127.0.0.1)\n  File ...\n" * 20
    )
    wrapper.cause = cause
    line, _ = describe(wrapper)
    assert line.startswith("failed: EngineStartError: vllm-replica-0: its command's program 'vllm'")
    assert "ray::" not in line


def test_a_local_engine_and_what_it_starts_run_only_on_its_cores(tmp_path):
    """``cpus``: the server and the process it forks are held to the named core from their
    first instruction (the spawner forks them on it); the caller's own cores are untouched."""
    own = os.sched_getaffinity(0)
    core = max(own)
    pool = LocalEnginePool(fake_spec(tmp_path, count=1, extra=["--setsid-child"], cpus=(core,)))
    with pool as addresses:
        assert get(addresses[0] + "/health") == 200
        pids = procs.pids_of_run(pool.run_id)
        assert len(pids) >= 2  # the server and its forked child
        assert all(os.sched_getaffinity(pid) == {core} for pid in pids)
    assert os.sched_getaffinity(0) == own


def test_an_engine_on_cores_this_host_lacks_is_refused_in_one_line(tmp_path):
    missing = max(os.sched_getaffinity(0)) + 1
    pool = LocalEnginePool(fake_spec(tmp_path, count=1, cpus=(missing,)))
    with pytest.raises(EngineStartError, match=rf"cores \[{missing}\] are not available here") as err:
        pool.start()
    assert "\n" not in str(err.value)
    assert procs.pids_of_run(pool.run_id) == []
