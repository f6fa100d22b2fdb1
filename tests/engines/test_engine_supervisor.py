"""EngineSupervisor on real processes: stand-in engines (real HTTP servers that need the run key)
are SIGKILLed and SIGSTOPped; the supervisor must notice within its bound, replace them, bring
the replacement to the pool's weight version before it takes traffic, and retry or refuse the
requests that were in flight. The weight load is a real keyed HTTP call to the engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from modal_rl.cluster import procs
from modal_rl.engines.base import Engine
from modal_rl.engines.health import PROBE_ID_PREFIX, generation_probe, vllm_generate
from modal_rl.engines.pool import EngineSpec
from modal_rl.engines.pool_local import LocalEnginePool
from modal_rl.engines.supervisor import EngineLost, EngineSupervisor, WeightSource
from modal_rl.run_key import RUN_KEY_ENV, engine_bearer, new_run_key

SERVER = str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py"))
INTERVAL_S, PROBE_S, FAILURES = 0.2, 1.0, 2
# What the supervisor promises (module docstring), plus slack for a shared 2-core host.
DEAD_BOUND_S = INTERVAL_S + 3.0
HUNG_BOUND_S = FAILURES * (INTERVAL_S + PROBE_S) + 3.0


@pytest.fixture(autouse=True)
def key(monkeypatch) -> str:
    value = new_run_key()
    monkeypatch.setenv(RUN_KEY_ENV, value)
    return value


def records(state: Path, url: str) -> list[dict]:
    path = state / f"{url.rsplit(':', 1)[1]}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def post(url: str, path: str, body: dict, key: str, timeout: float = 10.0) -> dict:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {engine_bearer(key)}"}
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.load(resp)


class StandInEngine(Engine):
    """The stand-in server behind the Engine port: a weight load is a real keyed call to it
    (the stand-in records it)."""

    name = "stand-in"

    def __init__(self, key: str):
        super().__init__(key=key)
        self.calls = []

    def argv(self) -> list[str]:
        return [sys.executable, SERVER, "--host", "{host}", "--port", "{port}"]

    def load(self, url: str, source: WeightSource) -> dict:
        post(url, "/collective_rpc", {"method": "load", "version": source.version}, self.key, 3.0)
        self.calls.append((url, source.version, time.time()))
        return {"version": float(source.version)}


def supervised(tmp_path, key, count=1) -> EngineSupervisor:
    command = [sys.executable, SERVER, "--host", "{host}", "--port", "{port}", "--state", str(tmp_path)]
    spec = EngineSpec(command=[*command, "--require-key"], count=count, generate=vllm_generate("m"))
    pool = LocalEnginePool(spec, log_dir=str(tmp_path / "logs"))
    return EngineSupervisor(
        pool, StandInEngine(key), interval_s=INTERVAL_S, probe_timeout_s=PROBE_S, failures=FAILURES
    )


def wait_for(events: list, kind: str, bound_s: float, after: int = 0) -> dict:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        found = [e for e in events[after:] if e["kind"] == kind]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {kind!r} event within {bound_s:.1f}s: {events[after:]}")


def test_health_is_a_keyed_one_token_generation(tmp_path, key):
    sup = supervised(tmp_path, key)
    with sup:
        (url,) = sup.pool.addresses
        assert generation_probe(url, vllm_generate("m"), key, 2.0)[0]
        assert generation_probe(url, vllm_generate("m"), None, 2.0) == (False, "generation answered HTTP 401")
        os.kill(sup.pool.pid(0), signal.SIGSTOP)  # the port stays open; nothing answers
        try:
            t0 = time.monotonic()
            ok, what = generation_probe(url, vllm_generate("m"), key, 1.0)
            assert not ok and "timed out" in what and time.monotonic() - t0 < 3.0
        finally:
            os.kill(sup.pool.pid(0), signal.SIGCONT)
    seen = [r for r in records(tmp_path, url) if r["path"] == "/v1/completions"]
    assert [r for r in seen if r["refused"]]  # the keyless probe was refused ...
    probes = [r["body"] for r in seen if not r["refused"]]  # ... the pool's own ones carried the key
    assert probes and all(
        b["max_tokens"] == 1 and b["request_id"].startswith(PROBE_ID_PREFIX) for b in probes
    )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_a_lost_engine_is_replaced_and_serves_only_after_it_holds_the_current_version(tmp_path, key, sig):
    sup = supervised(tmp_path, key)
    with sup:
        sup.set_source(WeightSource("127.0.0.1", 1, version=3))
        (old_url,) = sup.pool.addresses
        old_pid = sup.pool.pid(0)
        assert sup.acquire(1.0).version == 3 and sup.engine.calls[-1][:2] == (old_url, 3)
        mark = len(sup.events)
        killed_at = time.monotonic()
        os.kill(old_pid, sig)
        lost = wait_for(sup.events, "lost", DEAD_BOUND_S if sig == signal.SIGKILL else HUNG_BOUND_S, mark)
        detect_s = time.monotonic() - killed_at
        assert lost["pid"] == old_pid
        with pytest.raises(EngineLost):
            sup.acquire(0.0)  # nothing serves meanwhile: no request reaches the lost engine
        serving = wait_for(sup.events, "serving", 30.0, mark)
        lease = sup.acquire(1.0)
        new_url = sup.pool.addresses[0]
        assert lease.url == new_url != old_url and lease.version == 3 and lease.generation == 1
        assert sup.pool.pid(0) != old_pid and procs.alive([old_pid]) == []  # the hung one too
        # The replacement loaded v3 before it was declared serving.
        (load,) = [c for c in sup.engine.calls if c[0] == new_url]
        assert load[1] == 3 and load[2] <= serving["t"]
        assert serving["recovery_s"] > 0 and [e["kind"] for e in sup.events[mark:]][:2] == [
            "lost",
            "replaced",
        ]
        assert sup.timings()["recovery_s"] == [serving["recovery_s"]]
    print(f"detected {'SIGKILL' if sig == signal.SIGKILL else 'SIGSTOP'} in {detect_s:.2f}s")
    assert procs.pids_of_run(sup.pool.run_id) == []


def test_a_request_in_flight_on_a_hung_engine_is_retried_on_the_replacement(tmp_path, key):
    sup = supervised(tmp_path, key)

    async def send(lease):
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 4}
        return await asyncio.to_thread(post, lease.url, "/v1/completions", body, key, 60.0)

    with sup:
        sup.set_source(WeightSource("127.0.0.1", 1, version=0))
        os.kill(sup.pool.pid(0), signal.SIGSTOP)  # the request below goes to a hung engine
        answer, lease = asyncio.run(sup.run(send, wait_s=30.0))
        assert answer["choices"][0]["token_ids"] == [2, 3]
        assert lease.generation == 1 and lease.version == 0
        assert [e["kind"] for e in sup.events if e["kind"] in ("lost", "serving")] == ["lost", "serving"]


def test_a_retry_is_refused_when_the_weights_moved_on(tmp_path, key):
    """The request started on v0; its engine hangs and the pool moves to v1 meanwhile: the
    retry must not be answered by v1, so the caller gets EngineLost (and masks the sample)."""
    sup = supervised(tmp_path, key)

    async def send(lease):
        sup.set_source(WeightSource("127.0.0.1", 1, version=1))  # lands while v0's engine hangs
        await asyncio.sleep(60)

    with sup:
        sup.set_source(WeightSource("127.0.0.1", 1, version=0))
        os.kill(sup.pool.pid(0), signal.SIGSTOP)
        with pytest.raises(EngineLost, match="moved from v0 to v1"):
            asyncio.run(sup.run(send, wait_s=30.0))
        assert sup.acquire(30.0).version == 1  # the replacement caught up with v1


def test_local_pools_leave_no_temp_folder_and_keep_logs_asked_for(tmp_path, key):
    import tempfile

    command = [sys.executable, SERVER, "--host", "{host}", "--port", "{port}"]
    pool = LocalEnginePool(EngineSpec(command=command))
    with pool:
        owned = pool.log_dir
        assert owned.name.startswith("mrl-engines-") and owned.parent == Path(tempfile.gettempdir())
        assert pool.log_path(0).exists()
    assert not owned.exists()
    kept = LocalEnginePool(EngineSpec(command=command), log_dir=str(tmp_path / "asked"))
    with kept:
        pass
    assert (tmp_path / "asked" / "engine-0.log").exists()
    # A process that never calls stop() (it crashes out) still removes its folder at exit.
    script = (
        "import sys; from modal_rl.engines.pool_local import LocalEnginePool\n"
        "from modal_rl.engines.pool import EngineSpec\n"
        f"pool = LocalEnginePool(EngineSpec(command={command!r}))\n"
        "print(pool.log_dir, flush=True); pool.start(); sys.exit(3)\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert not Path(out.stdout.strip()).exists()
