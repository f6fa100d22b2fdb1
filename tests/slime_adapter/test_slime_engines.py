"""slime_modal.engines: flag parsing, the SGLang command from slime's flags, local engines that
slime's own external-engine discovery accepts, the Modal spec offline."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.cluster import procs
from modal_rl.engines.sglang_paths import WeightDirs, body_refusal
from modal_rl.run_key import new_run_key
from slime_modal.engines import (
    EnginesRequest,
    describe,
    engine_spec,
    external_engine_args,
    forwarded_job_command,
    parse_engines,
    running_engines,
)

SERVER = (sys.executable, str(Path(__file__).resolve().parents[1].joinpath("_engine_server.py")))
SLIME_MIRROR = Path("/work/.mirror/THUDM+slime/repo")
ARGV = [
    "--hf-checkpoint",
    "/models/Qwen3-4B",
    "--rollout-num-gpus-per-engine",
    "2",
    "--offload-rollout",
    "--sglang-mem-fraction-static",
    "0.7",
    "--sglang-context-length=8192",
    "--sglang-router-port",
    "3000",
    "--lr",
    "1e-6",
]


@pytest.mark.parametrize(
    "text, want",
    [
        ("modal:4", EnginesRequest(4, "H100", None)),
        ("modal:2:A100-80GB", EnginesRequest(2, "A100-80GB", None)),
        ("modal:2:h100:2", EnginesRequest(2, "H100", 2)),
    ],
)
def test_parse_engines(text, want):
    assert parse_engines(text) == want


@pytest.mark.parametrize(
    "text, needle",
    [
        ("local:4", "use modal:N"),
        ("modal", "use modal:N"),
        ("modal:x", "'x' is not an integer"),
        ("modal:0", "at least one engine"),
        ("modal:2:Z80", "unknown GPU type"),
        ("modal:2:H100:two", "not an integer"),
    ],
)
def test_parse_engines_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_engines(text)


def test_engine_command_follows_slime_flags():
    spec = engine_spec(parse_engines("modal:3:H100"), ARGV)
    assert spec.pulls_frames is False  # slime moves SGLang's weights: no frame-read key
    cmd = list(spec.command)
    # SGLang runs under our keyed launcher: its keys come from the env, not the command line.
    assert cmd[:7] == [
        "python3",
        "-m",
        "modal_rl.engines.keyed_launch",
        "--key-flag=--api-key",
        "--key-flag=--admin-api-key",
        "--guard=sglang",  # and our route allow-list in front of SGLang's app
        "sglang.launch_server",
    ]
    assert not any(a.startswith(("--api-key", "--admin-api-key")) for a in cmd)
    assert cmd[cmd.index("--model-path") + 1] == "/models/Qwen3-4B"
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--pp-size") + 1] == "1"
    assert "--enable-memory-saver" in cmd  # slime compares it with --offload-rollout
    assert cmd[-3:] == ["--mem-fraction-static", "0.7", "--context-length=8192"]
    assert "--router-port" not in cmd and "--lr" not in cmd
    assert spec.gpu == "H100:2" and spec.count == 3 and spec.image == "slimerl/slime:latest"


@pytest.mark.parametrize(
    "argv, request_text, needle",
    [
        (["--lr", "1"], "modal:1", "needs --hf-checkpoint"),
        (["--hf-checkpoint", "m", "--colocate"], "modal:1", "contradicts --colocate"),
        (["--hf-checkpoint", "m", "--rollout-external-engine-addrs", "h:1"], "modal:1", "one or the other"),
        (["--hf-checkpoint", "m", "--sglang-api-key", "k"], "modal:1", "take the run's key"),
        (["--hf-checkpoint", "m", "--sglang-admin-api-key=k"], "modal:1", "take the run's key"),
        (["--hf-checkpoint", "m", "--sglang-tokenizer-worker-num", "2"], "modal:1", "multi-tokenizer"),
        (["--hf-checkpoint", "m", "--update-weight-disk-dir", "w"], "modal:1", "give an absolute path"),
        (["--hf-checkpoint", "m", "--rollout-num-gpus-per-engine", "2"], "modal:1:H100:4", "make them agree"),
        (
            ["--hf-checkpoint", "m", "--rollout-num-gpus-per-engine", "3", "--sglang-pp-size", "2"],
            "modal:1",
            "multiple",
        ),
    ],
)
def test_contradictions_are_refused(argv, request_text, needle):
    with pytest.raises(ValueError, match=needle):
        describe(parse_engines(request_text), argv)


def test_describe_is_json_and_names_the_command():
    plan = describe(parse_engines("modal:2"), ARGV)
    json.dumps(plan)
    assert plan["count"] == 2 and plan["gpu_per_engine"] == "H100:2"
    assert plan["command"][plan["command"].index("--host") + 1] == "0.0.0.0"
    auth = plan["auth"]
    assert "--api-key" in auth["engine_key"] and "keyed_launch" in auth["engine_key"]
    assert "TLS" in auth["tunnel"] and "key_forwarder" in auth["forwarder"]
    assert plan["job_command"][:4] == ["python3", "-m", "slime_modal.engine_job", "--engine"]
    assert plan["job_command"][plan["job_command"].index("--") + 1] == "<entry>"


def test_forwarded_job_command():
    cmd = forwarded_job_command(["python3", "/root/slime/train.py", "--lr", "1"], ["https://a", "https://b"])
    assert cmd == [
        "python3",
        "-m",
        "slime_modal.engine_job",
        "--engine",
        "https://a",
        "--engine",
        "https://b",
        "--",
        "/root/slime/train.py",
        "--lr",
        "1",
    ]
    with pytest.raises(ValueError):
        forwarded_job_command(["python3", "t.py"], [])


def test_external_engine_args():
    assert external_engine_args(["http://a.modal.host:123", "http://b:9"]) == [
        "--rollout-external-engine-addrs",
        "http://a.modal.host:123",
        "http://b:9",
    ]
    for bad in (["https://a:1"], ["a:1"], ["http://a"], []):
        with pytest.raises(ValueError):
            external_engine_args(bad)


def _slime_external():
    """slime's own external-engine helpers, read from a slime checkout (``SLIME_PATH``) or the
    tool library's mirror, never copied here; skipped where neither exists (a fresh CI box)."""
    rel = "slime/backends/sglang_utils/external.py"
    if os.environ.get("SLIME_PATH"):
        src = (Path(os.environ["SLIME_PATH"]) / rel).read_text()
    elif SLIME_MIRROR.exists():
        show = ["git", "-C", str(SLIME_MIRROR), "show", f"HEAD:{rel}"]
        src = subprocess.run(show, capture_output=True, text=True, check=True).stdout
    else:
        pytest.skip("no slime checkout (SLIME_PATH) or mirror")
    spec = importlib.util.spec_from_loader("slime_external_under_test", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        exec(compile(src, "slime/backends/sglang_utils/external.py", "exec"), module.__dict__)
    finally:
        del sys.modules[spec.name]
    return module


def test_local_engines_pass_slimes_discovery(tmp_path, monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)  # slime's requests would send 127.0.0.1 to a proxy
    monkeypatch.setenv("MODAL_RL_RUN_KEY", new_run_key())  # keyed engines start only with the run's key
    slime_external = _slime_external()
    argv = ["--hf-checkpoint", "/models/tiny", "--rollout-num-gpus-per-engine", "1", "--offload"]
    request = parse_engines("modal:2")
    pool_kwargs = {"log_dir": str(tmp_path)}
    before = set(procs.children_of(os.getpid()))  # other tests' children are not ours to judge
    with running_engines(request, argv, backend="local", server=SERVER, pool_kwargs=pool_kwargs) as addresses:
        flag, *addrs = external_engine_args(addresses)
        infos = slime_external.discover_external_engines(addrs, timeout=5)
        assert [i.worker_type for i in infos] == ["regular", "regular"]
        assert [i.num_gpus for i in infos] == [1, 1]
        assert all(i.server_info["enable_memory_saver"] is True for i in infos)
        assert all(i.server_info["model_path"] == "/models/tiny" for i in infos)
        engines = [pid for pid in procs.children_of(os.getpid()) if pid not in before]
        assert len(procs.alive(engines)) >= 2
    assert procs.alive(engines) == []


def test_modal_engine_function_offline():
    from modal_rl.engines.pool_modal import ModalEnginePool

    spec = engine_spec(parse_engines("modal:2:H100"), ARGV, volumes={"models": "/models"})
    plan = ModalEnginePool(spec).describe()
    inspected = plan["modal_function"]["inspected"]
    assert inspected["gpu"] == "H100:2" and inspected["volumes"] == {"/models": "models"}
    assert plan["modal_function"]["max_containers"] == 2
    assert plan["commands"][0][plan["commands"][0].index("--port") + 1] == "30000"


def test_the_engines_weight_routes_take_only_slime_s_own_dirs(tmp_path):
    """The spec's environment names the model, the disk dir and the local checkpoint dir; the
    bodies slime's ``SGLangEngine.pull_weights`` / ``update_weights_from_disk`` send with those
    flags pass the engine's check, a path elsewhere does not."""
    disk, local = str(tmp_path / "disk"), str(tmp_path / "local")
    argv = [*ARGV, "--update-weight-transport", "disk", "--update-weight-disk-dir", disk]
    argv += ["--update-weight-local-checkpoint-dir", local]
    spec = engine_spec(parse_engines("modal:1"), argv, env={"OTHER": "1"})
    assert WeightDirs.from_env(spec.env) == WeightDirs(("/models/Qwen3-4B", disk), (local,))
    dirs = WeightDirs.from_env(spec.env).resolved()
    pull = {"local_checkpoint_dir": local, "source_dir": disk, "target_version": 3}
    assert body_refusal("/pull_weights", [], json.dumps(pull).encode(), dirs) is None
    for model_path in (local, f"{disk}/weight_v000003", "/etc", f"{disk}/../elsewhere"):
        body = json.dumps({"model_path": model_path, "weight_version": "3"}).encode()
        why = body_refusal("/update_weights_from_disk", [], body, dirs)
        assert (why is None) == (model_path in (local, f"{disk}/weight_v000003")), why
    nccl = engine_spec(parse_engines("modal:1"), ARGV)  # no disk path: the model alone
    assert WeightDirs.from_env(nccl.env) == WeightDirs(("/models/Qwen3-4B",), ())


def test_modal_dry_run_shows_engine_auth_and_never_the_key(monkeypatch):
    from tests._launcher import run_module

    key = "dry-run-key-" + "z" * 40
    monkeypatch.setenv("MODAL_RL_RUN_KEY", key)
    out, _ = run_module(
        "slime_modal",
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--rollout-engines",
        "modal:2",
        "--volume",
        "models:/models",
        "--dry-run",
        "--json",
        "--",
        *ARGV,
    )
    assert out.returncode == 0, out.stderr
    assert key not in out.stdout and key not in out.stderr
    engines = json.loads(out.stdout)["rollout_engines"]
    assert engines["count"] == 2
    assert "modal_rl.engines.keyed_launch" in engines["command"]
    assert not any(a in engines["command"] for a in ("--api-key", "--admin-api-key"))
    auth = engines["auth"]
    assert "TLS" in auth["tunnel"] and "every other route refused" in auth["key_required"]
    assert '"load": ["/models/Qwen3-4B"]' in auth["weight_dirs"]  # the weight routes' only paths
    assert "key_forwarder" in auth["forwarder"] and "Bearer" in auth["forwarder"]
    assert engines["job_command"][2] == "slime_modal.engine_job"
