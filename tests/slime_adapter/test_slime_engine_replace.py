"""slime's rollout engines replaced like verl's: a dead engine's spec is started again, brought to
slime's newest published weights through slime's own weight path (``/pull_weights`` then
``/update_weights_from_disk``), and only then routed to by the job's key forwarder, whose port
for it held slime's requests meanwhile. SGLang cannot run here: the engine is the keyed SGLang
stand-in (``_sglang_auth_server``, real HTTP, real key checks) under the real keyed launcher,
in a real local pool under the real supervisor, behind the real forwarder child."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from modal_rl.run_key import new_run_key
from slime_modal import engine_job
from slime_modal.engines import (
    KEY_FLAGS,
    EnginesRequest,
    forwarded_job_command,
    replacement_problem,
    running_engines,
)
from slime_modal.weight_hooks import INDEX, newest_version

TESTS = Path(__file__).resolve().parents[1]
KEYED_STAND_IN = (
    sys.executable,
    "-m",
    "modal_rl.engines.keyed_launch",
    *(f"--key-flag={flag}" for flag in KEY_FLAGS),
    "_sglang_auth_server",
)


def publish(disk_dir: Path, version: int, *, complete: bool = True) -> None:
    """A version directory as slime's delta publisher leaves it: shard(s) + the HF index."""
    vdir = disk_dir / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    shard = "model-00000-of-00001.safetensors"
    (vdir / INDEX).write_text(
        json.dumps({"metadata": {"version": f"{version:06d}"}, "weight_map": {"w": shard}})
    )
    if complete:
        (vdir / shard).write_bytes(b"delta")


def slime_argv(tmp_path: Path, transport: str = "disk") -> list[str]:
    return [
        "--hf-checkpoint",
        "/models/tiny",
        "--update-weight-transport",
        transport,
        "--update-weight-mode",
        "delta",
        "--update-weight-disk-dir",
        str(tmp_path / "published"),
        "--update-weight-local-checkpoint-dir",
        str(tmp_path / "local-ckpt"),
        "--sglang-state",
        str(tmp_path / "state"),  # the stand-in's request log (SGLang: --state)
    ]


def test_newest_version_counts_only_complete_versions(tmp_path):
    assert newest_version(tmp_path / "none") == 0 and newest_version(None) == 0
    publish(tmp_path, 1)
    publish(tmp_path, 2)
    publish(tmp_path, 3, complete=False)  # its index names a shard not written yet
    (tmp_path / "weight_vjunk").mkdir()
    assert newest_version(tmp_path) == 2


def test_replacement_needs_slimes_disk_path_and_the_local_backend(tmp_path):
    assert replacement_problem(slime_argv(tmp_path), "local") is None
    assert "NCCL" in replacement_problem(slime_argv(tmp_path, "nccl"), "local")
    assert "Modal" in replacement_problem(slime_argv(tmp_path), "modal")


def test_the_job_command_carries_the_routes_file_and_the_job_parses_it():
    class Urls(list):
        routes = "/run/routes.json"

    cmd = forwarded_job_command(["python3", "train.py", "--lr", "1"], Urls(["http://e0:1"]))
    assert cmd[cmd.index("--routes") + 1] == "/run/routes.json" and cmd.index("--routes") < cmd.index("--")
    engines, entry, args, routes = engine_job.parse(cmd[3:])
    assert (engines, entry, args, routes) == (["http://e0:1"], "train.py", ["--lr", "1"], "/run/routes.json")
    assert engine_job.parse(["--engine", "http://e:1", "--", "t.py"])[3] is None
    with pytest.raises(ValueError, match="usage"):
        engine_job.parse(["--routes", "f", "--", "t.py"])  # no engine


def _post(url: str, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def _requests(state: Path, url: str) -> list[dict]:
    port = url.rsplit(":", 1)[1]
    path = state / f"{port}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_killed_engine_is_replaced_caught_up_through_slimes_path_then_routed(tmp_path, monkeypatch):
    monkeypatch.setenv("MODAL_RL_RUN_KEY", new_run_key())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "state").mkdir()
    publish(tmp_path / "published", 1)
    publish(tmp_path / "published", 2)  # slime's newest: what the replacement must hold
    argv = slime_argv(tmp_path)
    health = {"interval_s": 0.3, "probe_timeout_s": 5.0, "failures": 2}
    engines = running_engines(
        EnginesRequest(2, "H100"),
        argv,
        backend="local",
        server=KEYED_STAND_IN,
        health=health,
        pool_kwargs={"log_dir": str(tmp_path / "logs")},
    )
    with engines as addresses:
        supervisor = addresses.supervisor
        routes = Path(addresses.routes)
        assert json.loads(routes.read_text()) == {"upstreams": list(addresses)}
        proc, forwarded = engine_job.start_forwarder(list(addresses), "127.0.0.1", None, str(routes))
        try:
            assert _post(forwarded[0], "/generate", {"text": "before"})[0] == 200
            old_url = addresses[0]
            os.killpg(supervisor.pool.pid(0), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while json.loads(routes.read_text())["upstreams"][0] is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert json.loads(routes.read_text())["upstreams"][0] is None, "the lost slot kept its route"
            time.sleep(0.5)  # the forwarder has read the hold
            held: dict = {}
            sender = threading.Thread(
                target=lambda: held.update(answer=_post(forwarded[0], "/generate", {"text": "held"}))
            )
            sender.start()
            deadline = time.monotonic() + 120
            while not any(e["kind"] == "serving" for e in supervisor.events) and time.monotonic() < deadline:
                time.sleep(0.1)
            sender.join(60)
            serving = [e for e in supervisor.events if e["kind"] == "serving"]
            assert serving, [e["kind"] for e in supervisor.events]
            new_url = json.loads(routes.read_text())["upstreams"][0]
            assert new_url == supervisor.engines[0].url != old_url
            assert held.get("answer", (None,))[0] == 200  # held, then answered by the replacement
            seen = _requests(tmp_path / "state", new_url)
            paths = [r["path"] for r in seen]
            pull, reload = paths.index("/pull_weights"), paths.index("/update_weights_from_disk")
            (slime_request,) = [i for i, r in enumerate(seen) if '"held"' in r["body"]]
            assert pull < reload < slime_request, paths  # caught up before it took slime's request
            assert json.loads(seen[pull]["body"]) == {
                "local_checkpoint_dir": str(tmp_path / "local-ckpt"),
                "source_dir": str(tmp_path / "published"),
                "target_version": 2,
            }
            assert json.loads(seen[reload]["body"]) == {
                "model_path": str(tmp_path / "local-ckpt"),
                "weight_version": "2",
            }
            caught = [e for e in supervisor.events if e["kind"] == "caught_up"]
            assert caught and caught[0]["weight_version"] == 2
            # The other engine kept its route and never saw a catch-up.
            assert json.loads(routes.read_text())["upstreams"][1] == addresses[1]
            assert "/pull_weights" not in [r["path"] for r in _requests(tmp_path / "state", addresses[1])]
        finally:
            engine_job.stop_forwarder(proc)
    assert not routes.exists()  # the routes file goes with the run
