"""ForwardedEngines: a supervised local pool behind an in-process key forwarder.

Real processes (the keyed stand-in engine ``_engine_server.py``, which refuses requests without
the engine bearer), the real supervisor and the real forwarder. A client without the key gets
answers through the forwarder's fixed port; a killed engine's port holds the client's request
and gives it to the replacement only after the catch-up returned; ``wait_serving`` notices an
ended process at once; ``stop`` ends the ports and the engines.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from modal_rl.engines.base import Engine
from modal_rl.engines.forwarded import ForwardedEngines
from modal_rl.engines.health import vllm_generate
from modal_rl.engines.pool import EngineSpec
from modal_rl.engines.pool_local import LocalEnginePool
from modal_rl.run_key import RUN_KEY_ENV, new_run_key

SERVER = str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py"))


@pytest.fixture(autouse=True)
def key(monkeypatch) -> str:
    value = new_run_key()
    monkeypatch.setenv(RUN_KEY_ENV, value)
    return value


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, str]:
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_a_fixed_keyed_port_per_engine_held_across_a_replacement(tmp_path):
    command = [sys.executable, SERVER, "--host", "{host}", "--port", "{port}", "--require-key"]
    spec = EngineSpec(command=[*command, "--state", str(tmp_path)], count=2, generate=vllm_generate("m"))
    pool = LocalEnginePool(spec, log_dir=str(tmp_path / "logs"))
    caught: list[tuple[str, float]] = []

    class SlowCatchUp(Engine):
        """The stand-in behind the Engine port, with a catch-up that takes a while."""

        name = "stand-in"

        def argv(self) -> list[str]:
            return command

        def catch_up(self, url: str) -> dict:
            time.sleep(0.5)  # a catch-up takes a while; the port must hold meanwhile
            caught.append((url, time.monotonic()))
            return {"weight_version": 7}

    engines = ForwardedEngines(pool, SlowCatchUp(), health={"interval_s": 0.2, "probe_timeout_s": 2.0})
    with engines:
        ports = list(engines.addresses)
        upstream = [e["url"] for e in engines.supervisor.snapshot()]
        assert len(ports) == 2 and set(ports).isdisjoint(upstream)
        assert post(upstream[0], {"prompt": "x"})[0] == 401  # the engine needs the key
        assert post(ports[0], {"prompt": "x"})[0] == 200  # the forwarder adds it

        os.killpg(pool.pid(0), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engines.supervisor.snapshot()[0]["status"] == "serving" and time.monotonic() < deadline:
            time.sleep(0.02)  # the loss is seen: the port holds from here on
        answered: dict = {}

        def send() -> None:
            answered["r"] = post(ports[0], {"p": 1})
            answered["at"] = time.monotonic()

        sender = threading.Thread(target=send)
        sender.start()
        engines.wait_serving(60.0)
        sender.join(60)
        assert answered["r"][0] == 200  # held, then answered by the replacement
        replacement = engines.supervisor.snapshot()[0]
        assert replacement["generation"] == 1 and replacement["url"] != upstream[0]
        assert caught and caught[0][0] == replacement["url"] and caught[0][1] <= answered["at"]
        seen = (tmp_path / f"{replacement['url'].rsplit(':', 1)[1]}.jsonl").read_text().splitlines()
        assert {"p": 1} in [json.loads(line)["body"] for line in seen]  # it reached the replacement
        assert engines.addresses == ports  # the client's addresses never changed
        assert engines.supervisor.snapshot()[1]["generation"] == 0
        pids = [pool.pid(0), pool.pid(1)]
    assert engines.addresses == [] and pool.alive(0) is False and pool.alive(1) is False
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(ports[0] + "/health", timeout=5)
    engines.stop()  # idempotent
