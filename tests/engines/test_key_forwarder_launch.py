"""The key off the command line (modal_rl.engines.keyed_launch) and slime's job through the
forwarder (slime_modal.engine_job): real processes, real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from modal_rl.cluster import procs
from modal_rl.run_key import SECRET_ENVS, engine_bearer  # noqa: E402
from slime_modal.engine_job import listen_plan
from slime_modal.engines import KEY_FLAGS, parse_engines, running_engines

KEY = "run-key-" + "Q" * 40
REPO = Path(__file__).resolve().parents[2]
SLIME_MIRROR = Path("/work/.mirror/THUDM+slime/repo")
KEYED_SERVER = (
    sys.executable,
    "-m",
    "modal_rl.engines.keyed_launch",
    *(f"--key-flag={f}" for f in KEY_FLAGS),
    "_sglang_auth_server",
)


def _env(tmp_path: Path, key: str | None = KEY) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENVS and "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "tests")])
    if key:
        env["MODAL_RL_RUN_KEY"] = key
    return env


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_keyed_launch_adds_the_key_in_process_only(tmp_path):
    (tmp_path / "show_argv.py").write_text(
        textwrap.dedent(
            """
            import json, os, sys
            print(json.dumps({"argv": sys.argv[1:], "main": __name__ == "__main__", "pid": os.getpid()}), flush=True)
            sys.stdin.readline()  # stay alive until the test has read /proc
            """
        )
    )
    cmd = [sys.executable, "-m", "modal_rl.engines.keyed_launch", "--key-flag=--api-key"]
    cmd += ["--key-flag=--admin-api-key", "show_argv", "--port", "1"]
    proc = subprocess.Popen(cmd, env=_env(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        seen = json.loads(proc.stdout.readline())
        assert seen["pid"] == proc.pid  # the module ran in the launcher's own process
        assert seen["main"] is True
        bearer = engine_bearer(KEY)  # the engine gets its bearer, never the run key
        assert seen["argv"] == ["--port", "1", f"--api-key={bearer}", f"--admin-api-key={bearer}"]
        cmdline = _cmdline(proc.pid)
        assert "show_argv --port 1" in cmdline and KEY not in cmdline
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
        assert KEY not in ps
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize(
    "args, key, needle",
    [
        (
            ["--key-flag=--api-key", "show_argv"],
            None,
            "neither MODAL_RL_ENGINE_BEARER nor MODAL_RL_RUN_KEY is set",
        ),
        (["--key-flag=--api-key", "show_argv", "--api-key", "x"], KEY, "--api-key is set by keyed_launch"),
        (["--key-flag=api-key", "show_argv"], KEY, "give a long flag"),
        (["--key-flag=--api-key"], KEY, "no module to run"),
    ],
)
def test_keyed_launch_refuses_in_one_line(tmp_path, args, key, needle):
    out = subprocess.run(
        [sys.executable, "-m", "modal_rl.engines.keyed_launch", *args],
        env=_env(tmp_path, key),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and needle in out.stderr and "Traceback" not in out.stderr


def test_listen_plan():
    assert listen_plan({"NO_PROXY": "127.0.0.1,localhost,10.0.0.5"}) == ("127.0.0.1", None)
    assert listen_plan({}) == ("127.0.0.1", None)
    env = {"NO_PROXY": "127.0.0.1,localhost,10.0.0.5,10.0.0.6", "SLIME_HOST_IP": "10.0.0.5"}
    assert listen_plan(env) == ("10.0.0.5", ["127.0.0.1", "::1", "10.0.0.5", "10.0.0.6"])
    with pytest.raises(ValueError, match="SLIME_HOST_IP"):
        listen_plan({"no_proxy": "127.0.0.1,10.0.0.5,10.0.0.6"})


ENTRY = """
import json, os, sys
import requests

flag = sys.argv.index("--rollout-external-engine-addrs")
addrs = sys.argv[flag + 1 :]
out = {"main": __name__ == "__main__", "path0": sys.path[0], "addrs": addrs}
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import slime_external  # slime's own external.py, when a slime checkout is around
    infos = slime_external.discover_external_engines(addrs, timeout=10)
    out["slime_discovery"] = [i.server_info for i in infos]
except ImportError:
    pass
out["server_info"] = [requests.get(a + "/server_info", timeout=10).json() for a in addrs]
out["pull"] = [requests.post(a + "/pull_weights", json={"target_version": 1}, timeout=10).status_code for a in addrs]
out["big"] = [requests.post(a + "/update_weights_from_tensor", data=b"x" * (8 << 20), timeout=60).status_code for a in addrs]
print("RESULT " + json.dumps(out), flush=True)
"""


def _slime_external_source() -> str | None:
    if os.environ.get("SLIME_PATH"):
        return (Path(os.environ["SLIME_PATH"]) / "slime/backends/sglang_utils/external.py").read_text()
    if SLIME_MIRROR.exists():
        show = ["git", "-C", str(SLIME_MIRROR), "show", "HEAD:slime/backends/sglang_utils/external.py"]
        return subprocess.run(show, capture_output=True, text=True, check=True).stdout
    return None


def _get(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_slime_job_reaches_keyed_engines_only_through_the_forwarder(tmp_path, monkeypatch):
    monkeypatch.setenv("MODAL_RL_RUN_KEY", KEY)
    # The local engines inherit our env and import the stand-in server from tests/.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests")]))
    for var in [v for v in os.environ if "proxy" in v.lower()]:
        monkeypatch.delenv(var)
    state = tmp_path / "state"
    state.mkdir()
    entry = tmp_path / "train.py"
    entry.write_text(ENTRY)
    source = _slime_external_source()
    if source is not None:
        (tmp_path / "slime_external.py").write_text(source)  # read at test time, not kept
    argv = ["--hf-checkpoint", "/models/tiny", "--rollout-num-gpus-per-engine", "1"]
    argv += ["--sglang-state", str(state)]
    before = set(procs.children_of(os.getpid()))
    request = parse_engines("modal:2")
    pool = {"log_dir": str(tmp_path / "logs")}
    with running_engines(request, argv, backend="local", server=KEYED_SERVER, pool_kwargs=pool) as urls:
        engines = [p for p in procs.children_of(os.getpid()) if p not in before]
        assert engines and all(KEY not in _cmdline(p) for p in engines if Path(f"/proc/{p}").exists())
        for url in urls:  # direct: refused without the key, health stays open
            assert _get(url + "/server_info") == 401
            assert _get(url + "/server_info", "wrong") == 401
            assert _get(url + "/health") == 200
            assert _get(url + "/server_info", KEY) == 401  # the run key itself opens no engine
            assert _get(url + "/server_info", engine_bearer(KEY)) == 200  # its bearer, from the launcher
        with open(state / "before.txt", "w") as f:
            f.write("".join(p.read_text() for p in state.glob("*.jsonl")))
        cmd = [sys.executable, "-m", "slime_modal.engine_job"]
        for url in urls:
            cmd += ["--engine", url]
        cmd += ["--", str(entry), "--lr", "1e-6"]
        job = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert job.returncode == 0, job.stderr[-3000:]
    assert KEY not in job.stdout and KEY not in job.stderr
    result = json.loads(job.stdout.split("RESULT ", 1)[1])
    assert result["main"] is True and result["path0"] == str(tmp_path)
    assert len(result["addrs"]) == 2 and all(a.startswith("http://127.0.0.1:") for a in result["addrs"])
    assert not set(result["addrs"]) & set(urls)
    assert [i["model_path"] for i in result["server_info"]] == ["/models/tiny"] * 2
    assert all(
        i["api_key"] == "<redacted>" and i["admin_api_key"] == "<redacted>" for i in result["server_info"]
    )
    assert result["pull"] == [200, 200] and result["big"] == [200, 200]
    if source is not None:
        assert [i["model_path"] for i in result["slime_discovery"]] == ["/models/tiny"] * 2
    served = [json.loads(line) for p in state.glob("*.jsonl") for line in p.read_text().splitlines()]
    assert sum(r["path"] == "/pull_weights" for r in served) == 2
    assert sorted(r["bytes"] for r in served if r["path"] == "/update_weights_from_tensor") == [8 << 20] * 2
    time.sleep(0.5)
    forwarders = [p for p in procs.children_of(os.getpid()) if "key_forwarder" in _safe_cmdline(p)]
    assert forwarders == []


def _safe_cmdline(pid: int) -> str:
    try:
        return _cmdline(pid)
    except OSError:
        return ""


def test_engine_job_needs_the_key(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "slime_modal.engine_job", "--engine", "http://127.0.0.1:1", "--", "x.py"],
        env=_env(tmp_path, None),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "MODAL_RL_RUN_KEY" in out.stderr and "Traceback" not in out.stderr


def test_a_key_that_starts_with_a_dash_reaches_argparse_whole():
    # URL-safe keys start with "-" 1 time in 32: as a separate word argparse took it for a flag
    # and the engine exited with "expected one argument" (seen in the suite).
    import argparse

    from modal_rl.engines.keyed_launch import keyed_args

    ap = argparse.ArgumentParser()
    ap.add_argument("--api-key")
    ap.add_argument("--admin-api-key")
    ns = ap.parse_args(keyed_args(["--api-key", "--admin-api-key"], [], "-k3y_x"))
    assert ns.api_key == ns.admin_api_key == "-k3y_x"
